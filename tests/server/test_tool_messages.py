"""An assistant message with "content": null and tool_calls (what the openai client sends back after a tool
call) renders in a real template that concatenates message['content'] (SmolLM2's), as "" does."""
from __future__ import annotations

from nanoserve.model_files import load_tokenizer
from nanoserve.server.protocol import ChatCompletionRequest


def test_null_content_with_tool_calls_renders_in_smollm2_template(smollm2_gguf):
    tokenizer = load_tokenizer(str(smollm2_gguf))
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]})
    messages = [m.for_template() for m in body.messages]
    assert messages[1]["content"] == "" and messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>assistant\n<|im_end|>" in text and "18 C, sunny" in text
