"""The chat service: conversations with persistent cross-turn KV memory.

    service.py   ChatService: the API app.py calls (sessions, turns, documents, export, cache)
    turns.py     one reply / one resume on the engine, under the engine gate
    kv.py        spans <-> Contexts: restore (verified) and save (content-addressed prefix)
    render.py    conversation -> chat-template token ids; where the documents go
    runtime.py   engine gate, per-conversation cancel flags, LRU of warm Contexts
    reads.py     the share of the context each decode step read (shown with every reply)
    records.py   Turn, SessionInfo, ChatMessage, DocumentInfo, ResumeReport
    export.py    Markdown and JSON exports
    errors.py    ChatError and its subclasses (ValueErrors with the fix in the message)
    testing.py   a tiny random engine with a byte tokenizer (tests, crash soak)

The only package that combines spotlight/ (the engine) with memory/ (the store).
"""
