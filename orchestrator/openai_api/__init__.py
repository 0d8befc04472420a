"""The orchestrator's OpenAI-compatible HTTP API, split as vLLM's OpenAI front is: `protocol`
(the request bodies and their Prompt and RequestOptions, the response shapes, errors),
`serving` (the completion and chat handlers, streaming) and `server` (the app, its routes and
checks, and the uvicorn server beside the gRPC one)."""
