"""The OpenAI-compatible endpoints: request/response models (protocol*), and one serving module
per route (completions, chat, responses, embeddings), with constraints and tool calls."""
