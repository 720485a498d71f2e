"""The web playground: Gradio Blocks mounted in FastAPI (uvicorn), the engine client and supervisor, share pages."""
