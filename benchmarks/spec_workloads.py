"""Builds the speculative-decoding benchmark's prompt sets (benchmarks/speculative.py reads them):

    python benchmarks/spec_workloads.py      # → benchmarks/workloads/spec_copy.json, spec_chat.json

copy: a task over a GIVEN passage that the answer mostly repeats (quote, rewrite, fix, reformat), the workload where
drafting from the context pays; the passages are real text every Python ships (stdlib sources through
inspect.getsource, the language reference's pydoc topics), cut at a line to at most PASSAGE_TOKENS[1] tokens of
SmolLM2's tokenizer. Typos and a bug are put in deterministically (seeded), so "fix" prompts have something to fix.
chat: open-ended questions without a passage, where drafts from the context rarely hit. The JSON files are
committed: the benchmark never rebuilds them, so a Python version whose sources differ changes nothing.
"""
from __future__ import annotations

import importlib
import inspect
import json
import platform
import random
import sys
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

WORKLOADS_DIR = Path(__file__).resolve().parent / "workloads"
PASSAGE_TOKENS = (200, 800)  # each copy passage's length in SmolLM2 tokens (cut at a line boundary above it)
TYPO_RATE, TYPO_SEED = 0.08, 0  # share of the words of 5+ letters whose two middle letters are swapped

# (instruction, source, edit): source is "code:MODULE.NAME[+MODULE.NAME]" or "topic:NAME" (pydoc_data.topics);
# edit is None, "typos", or ("replace", old, new): a one-off change put into the passage.
COPY_TASKS = [
    ("Repeat the following code exactly.", "code:textwrap.dedent", None),
    ("Repeat the following code exactly, adding a docstring to each function.",
     "code:colorsys.rgb_to_hls+colorsys.hls_to_rgb+colorsys._v", None),
    ("Rewrite the following code with type hints on every function signature. Change nothing else.",
     "code:queue.Queue.get+queue.Queue.put", None),
    ("Output the following code in full, renaming the function `do_longs` to `parse_long_options` everywhere.",
     "code:getopt.getopt+getopt.do_longs", None),
    ("Remove all comments from the following code and output the rest unchanged.", "code:copy.deepcopy", None),
    ("The following function has a typo in a variable name that makes it fail. Output the corrected function in "
     "full.", "code:urllib.parse.urljoin", ("replace", "    base_parts = bpath.split('/')",
                                            "    base_parts = bpth.split('/')")),
    ("Rewrite the following function without its docstring; keep the code exactly the same.", "code:json.dumps",
     None),
    ("Repeat this code exactly, then explain in one sentence what it does.",
     "code:fractions.Fraction.limit_denominator", None),
    ("Quote the passage verbatim.", "topic:for", None),
    ("Copy this text, fixing the typos.", "topic:exceptions", "typos"),
    ("Rewrite the following text as a bulleted list, keeping the original wording.", "topic:context-managers", None),
    ('Repeat the following text, replacing every occurrence of "object" with "value".', "topic:booleans", None),
    ("Edit the text below: fix the spelling mistakes and keep everything else exactly as it is.", "topic:class",
     "typos"),
    ("Quote the following documentation exactly, then add one sentence summarizing it.", "topic:dict", None),
    ("Convert the following text to Markdown: make the first line a heading and put code examples in code blocks. "
     "Keep the wording.", "topic:global", None),
    ("Repeat the passage below word for word, with each sentence on its own line.", "topic:typesmethods", None),
]

CHAT_QUESTIONS = [
    "What are some good habits for staying productive when working from home?",
    "Explain why the sky is blue to a ten-year-old.",
    "Write a short story about a robot who learns to paint.",
    "What should I consider when choosing my first programming language?",
    "Give me some ideas for a healthy weekday breakfast.",
    "Why do people enjoy listening to sad music?",
    "What are the pros and cons of living in a big city?",
    "Write a friendly email inviting my neighbours to a garden party.",
    "How do vaccines train the immune system?",
    "Suggest a plan for learning to play the guitar in three months.",
    "What makes a good team leader?",
    "Write a poem about the ocean at night.",
    "How can I reduce the amount of plastic I use at home?",
    "Explain the difference between weather and climate.",
    "What are some interesting things to do on a rainy weekend?",
    "How would you describe the taste of coffee to someone who has never had it?",
]


def _resolve(dotted: str):
    """module.attr.attr → the object (the longest importable prefix is the module)."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
            break
        except ImportError:
            continue
    for name in parts[i:]:
        obj = getattr(obj, name)
    return obj


def source_text(source: str) -> str:
    """The raw text a source names: functions' sources (dedented, blank line between) or a pydoc topic."""
    kind, _, name = source.partition(":")
    if kind == "topic":
        from pydoc_data.topics import topics

        return topics[name]
    if kind == "code":
        return "\n".join(textwrap.dedent(inspect.getsource(_resolve(n))) for n in name.split("+"))
    raise ValueError(f"unknown source kind {kind!r} in {source!r}")


def cut(text: str, count_tokens, most: int) -> str:
    """The longest prefix of whole lines of text within `most` tokens."""
    lines, kept = text.splitlines(keepends=True), []
    for line in lines:
        if count_tokens("".join(kept + [line])) > most:
            break
        kept.append(line)
    return "".join(kept)


def add_typos(text: str, rate: float = TYPO_RATE, seed: int = TYPO_SEED) -> str:
    """Swap the two middle letters of a seeded `rate` share of the alphabetic words of five or more letters."""
    rng = random.Random(seed)
    words = text.split(" ")
    for i, word in enumerate(words):
        if len(word) >= 5 and word.isalpha() and rng.random() < rate:
            m = len(word) // 2
            words[i] = word[:m - 1] + word[m] + word[m - 1] + word[m + 1:]
    return " ".join(words)


def apply_edit(text: str, edit) -> str:
    if edit is None:
        return text
    if edit == "typos":
        return add_typos(text)
    _, old, new = edit
    if old not in text:
        raise ValueError(f"the edit's text {old!r} is not in the passage")
    return text.replace(old, new, 1)


def copy_prompt(instruction: str, source: str, edit, count_tokens) -> dict:
    passage = apply_edit(cut(source_text(source), count_tokens, PASSAGE_TOKENS[1]), edit)
    tokens = count_tokens(passage)
    if not PASSAGE_TOKENS[0] <= tokens <= PASSAGE_TOKENS[1]:
        raise ValueError(f"{source}: {tokens} tokens, outside {PASSAGE_TOKENS}")
    body = f"```python\n{passage}```" if source.startswith("code:") else passage
    where = "inspect.getsource" if source.startswith("code:") else "pydoc_data.topics.topics"
    return {"source": f"Python {platform.python_version()} standard library, {where}: {source.split(':', 1)[1]}"
                      + ("" if edit is None else f" (edited: {edit if edit == 'typos' else 'one-line bug'})"),
            "passage_tokens": tokens, "messages": [{"role": "user", "content": f"{instruction}\n\n{body}"}]}


def build(count_tokens) -> dict[str, dict]:
    copy = [copy_prompt(*task, count_tokens) for task in COPY_TASKS]
    chat = [{"source": "written for this benchmark", "messages": [{"role": "user", "content": q}]}
            for q in CHAT_QUESTIONS]
    return {"copy": {"workload": "copy", "description": "rewrite / edit / quote a passage given in the prompt",
                     "prompts": copy},
            "chat": {"workload": "chat", "description": "open-ended questions, no passage to copy",
                     "prompts": chat}}


def main() -> int:
    from transformers import AutoTokenizer

    from benchmarks.fp8_quality import GGUF_FILE
    from benchmarks.kv_quality import smollm2_gguf

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_gguf().parent), gguf_file=GGUF_FILE)
    for name, workload in build(lambda s: len(tokenizer.encode(s, add_special_tokens=False))).items():
        path = WORKLOADS_DIR / f"spec_{name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(workload, indent=1, ensure_ascii=False) + "\n")
        print(f"wrote {path}: {len(workload['prompts'])} prompts")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
