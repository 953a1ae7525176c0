"""What the router and the CPU worker share: turning chats and texts into tokens (the
tokenizer, the chat template's skeleton, the token cache), and the formats both must agree
on (SGLang's JSON errors, KV events, the OpenAPI pieces, the PD caching modes)."""
