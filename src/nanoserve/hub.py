"""Models by Hugging Face hub id: `org/name` → a local snapshot folder or one GGUF file, through huggingface_hub.

A name that exists on disk is a local path and is used as it is; otherwise a name shaped like a hub id is
resolved in the hub's cache (`download_dir`, else huggingface_hub's own: HF_HUB_CACHE / HF_HOME), fetching
what is missing unless HF_HUB_OFFLINE is set. Only what the engine reads is fetched: config, tokenizer and
generation files and the safetensors weights, or exactly one GGUF file of a GGUF repository, chosen as

    org/name                 the repository's only .gguf file
    org/name:Q4_K_M          the .gguf file whose name carries that quantization tag
    org/name/model.Q8_0.gguf that file

Whether the hub can be reached is asked once, by one connection bounded in time (HUB_PROBE_TIMEOUT_S), before
huggingface_hub is: without network the cache alone answers at once. A model that is neither local nor cached
(offline, or the hub unreachable) or not on the hub is one error line naming it and how to fetch it. Resolution happens once, before the engine starts (LLM, build_app); the engine sees local paths.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import os
import re
import socket
import threading
from pathlib import Path
from urllib.parse import urlsplit

from nanoserve.config import HUB_PROBE_TIMEOUT_S

# What a safetensors model folder needs: config and generation config, tokenizer files, chat template, weights.
SNAPSHOT_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken"]
TOKENIZER_PATTERNS = ["*.json", "*.txt", "*.model", "*.jinja", "*.tiktoken"]
_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+?)(?::(?P<quant>[\w.-]+)|/(?P<file>[^/]+\.gguf))?$")
_TRUE = ("1", "true", "yes", "on")


class HubModelError(ValueError):
    """A hub id that cannot be resolved; the message names it and says how to fetch it."""


def is_hub_id(name: str) -> bool:
    """Not a path on disk, and shaped like `org/name` (optionally `:QUANT` or `/file.gguf`)."""
    return not Path(name).exists() and not name.startswith((".", "/", "~")) and _HUB_ID.match(name) is not None


def offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE) or os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def hub_reachable(timeout: float = HUB_PROBE_TIMEOUT_S) -> bool:
    """Whether a TCP connection to the hub's host (HF_ENDPOINT) opens within `timeout`. Name lookup included,
    which a socket timeout does not bound: the probe runs on a daemon thread that is given up on."""
    from huggingface_hub import constants

    url = urlsplit(constants.ENDPOINT)
    address = (url.hostname or "", url.port or (443 if url.scheme == "https" else 80))
    done, opened = threading.Event(), []

    def probe() -> None:
        try:
            socket.create_connection(address, timeout=timeout).close()
            opened.append(True)
        except OSError:
            pass
        finally:
            done.set()

    threading.Thread(target=probe, name="nanoserve-hub-probe", daemon=True).start()
    return done.wait(timeout) and bool(opened)


def resolve_config(config):
    """The EngineConfig with `model` (and a hub-id `tokenizer`, a draft model's hub id) replaced by local paths; local
    ones unchanged, a missing one refused."""
    from nanoserve.model_files import check_model_exists

    changes = {}
    if is_hub_id(config.model):
        changes["model"] = resolve_model(config.model, config.revision, config.download_dir)
    else:
        check_model_exists(config.model)
    spec = config.speculative
    if spec is not None and spec.method == "draft_model":  # the draft model: the same rules as the model
        if is_hub_id(spec.model):
            draft = resolve_model(spec.model, None, config.download_dir)
            changes["speculative_config"] = spec.as_dict() | {"model": draft}
        else:
            check_model_exists(spec.model)
    if config.tokenizer is not None and is_hub_id(config.tokenizer):
        changes["tokenizer"] = resolve_model(config.tokenizer, config.revision, config.download_dir,
                                             TOKENIZER_PATTERNS)
    return dataclasses.replace(config, **changes) if changes else config


def resolve_model(name: str, revision: str | None = None, download_dir: str | None = None,
                  patterns: list[str] | None = None) -> str:
    """A local folder (safetensors repository) or file (GGUF repository) for hub id `name`."""
    if not is_hub_id(name):
        return name
    m = _HUB_ID.match(name)
    repo, quant, file = m.group("repo"), m.group("quant"), m.group("file")
    local = offline() or not hub_reachable()
    try:
        if file is None:
            files = _repo_files(repo, revision, download_dir, local)
            weights = [f for f in files if f.endswith(".safetensors")]
            if patterns is not None or (weights and quant is None):
                folder = _snapshot(repo, revision, download_dir, patterns or SNAPSHOT_PATTERNS, local)
                if patterns is None and not (Path(folder) / "config.json").is_file():
                    raise HubModelError(f"hub model {name!r} has safetensors but no config.json ({folder})")
                return folder
            file = _pick_gguf(name, [f for f in files if f.endswith(".gguf")], quant)
        from huggingface_hub import hf_hub_download

        return hf_hub_download(repo, file, revision=revision, cache_dir=download_dir, local_files_only=local)
    except HubModelError:
        raise
    except Exception as e:  # huggingface_hub's errors: not cached offline, no such repo / revision / file, network
        raise HubModelError(_explain(name, repo, revision, download_dir, e)) from None


def _repo_files(repo: str, revision: str | None, download_dir: str | None, local: bool) -> list[str]:
    """The repository's file names: from the hub when online, else from the cached snapshot."""
    if not local:
        from huggingface_hub import HfApi

        try:
            return HfApi().list_repo_files(repo, revision=revision)
        except Exception as e:
            if not _is_connection_error(e):
                raise
    folder = _snapshot(repo, revision, download_dir, None, local_only=True)
    return [p.relative_to(folder).as_posix() for p in Path(folder).rglob("*") if p.is_file()]


def _snapshot(repo: str, revision: str | None, download_dir: str | None, patterns: list[str] | None,
              local_only: bool) -> str:
    from huggingface_hub import snapshot_download

    return snapshot_download(repo, revision=revision, cache_dir=download_dir, allow_patterns=patterns,
                             local_files_only=local_only)


def _pick_gguf(name: str, ggufs: list[str], quant: str | None) -> str:
    if not ggufs:
        raise HubModelError(f"hub model {name!r} has neither safetensors weights nor a .gguf file")
    if quant is not None:
        ggufs = [f for f in ggufs if fnmatch.fnmatch(Path(f).name.lower(), f"*{quant.lower()}*")]
    if len(ggufs) == 1:
        return ggufs[0]
    which = "none" if not ggufs else ", ".join(sorted(ggufs))
    raise HubModelError(f"hub model {name!r}: {'no' if not ggufs else len(ggufs)} .gguf files match"
                        f"{f' {quant!r}' if quant else ''} ({which}); choose one as 'org/name:QUANT' "
                        "(e.g. :Q4_K_M) or 'org/name/FILE.gguf'")


def _is_connection_error(e: Exception) -> bool:
    names = {c.__name__ for c in type(e).__mro__}
    return bool(names & {"ConnectionError", "ConnectError", "Timeout", "TimeoutException", "OfflineModeIsEnabled"})


def _explain(name: str, repo: str, revision: str | None, download_dir: str | None, e: Exception) -> str:
    """One line: what is missing and how to get it."""
    kind = type(e).__name__
    where = f" (revision {revision!r})" if revision else ""
    fetch = f"`hf download {repo}{f' --revision {revision}' if revision else ''}" \
            f"{f' --cache-dir {download_dir}' if download_dir else ''}`"
    if kind in ("RepositoryNotFoundError", "GatedRepoError"):
        return (f"model {name!r} is not a local path and the Hugging Face hub has no such repository{where} (or it "
                "is gated or private: log in with `hf auth login` or set HF_TOKEN)")
    if kind in ("RevisionNotFoundError", "EntryNotFoundError", "RemoteEntryNotFoundError"):
        return f"model {name!r}: {str(e).splitlines()[0]}"
    from huggingface_hub import constants

    cache = download_dir or constants.HF_HUB_CACHE
    why = "HF_HUB_OFFLINE is set" if offline() else f"the hub ({constants.ENDPOINT}) cannot be reached"
    return (f"model {name!r}{where} is neither a local path nor in the Hugging Face cache {cache}, and {why}; "
            f"fetch it first with {fetch} where there is network (HF_HUB_OFFLINE=1 then runs from the cache), "
            "or give a local model folder or .gguf file")


__all__ = ["resolve_config", "resolve_model", "is_hub_id", "HubModelError", "SNAPSHOT_PATTERNS"]
