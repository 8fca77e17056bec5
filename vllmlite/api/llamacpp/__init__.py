"""llama.cpp's llama-server surface: its native /completion endpoint, /tokenize with `content`,
/detokenize, /apply-template and /props, for clients written against llama-server
(docs/compatibility.md lists what is served, accepted and refused)."""
