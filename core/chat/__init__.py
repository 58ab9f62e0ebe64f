"""Chat formats every front door shares (the server, ChatSGLang): rendering, tool calls, OpenAI output shapes."""
