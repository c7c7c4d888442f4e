"""The server on the real SmolLM2 GGUF answers a chat question correctly (self-contained: the app in a TestClient)."""
from fastapi.testclient import TestClient

from nanoserve.server.app import build_app


def test_chat_completion_knows_the_capital_of_france(smollm2_gguf):
    app = build_app(str(smollm2_gguf), served_model_name="smollm2", device="cpu", max_model_len=512,
                    show_progress=False)
    question = {"model": "smollm2", "messages": [{"role": "user", "content": "What is the capital of France?"}],
                "max_completion_tokens": 24, "temperature": 0}
    with TestClient(app) as client:  # runs the lifespan: the engine thread starts and stops with it
        response = client.post("/v1/chat/completions", json=question)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert "Paris" in choice["message"]["content"], choice
