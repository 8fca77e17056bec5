"""The operator's pages: /v1/stats, /debug/* and the web page at / (static files, no CDN)."""
