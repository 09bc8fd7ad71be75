"""Where a checkpoint comes from: a local directory, or a Hugging Face repo id through the hub's cache.

Every family that loads a checkpoint (Qwen3-Omni, Qwen3-TTS, the voice pipeline's
transformers Thinker) names it the same way: ``--model`` and a stage's
``executor_args.model_dir`` take a local path or a repo id (``owner/name``).

* :func:`is_repo_id` — ``owner/name`` that is not an existing local path (an existing
  path always wins; a missing path that does not look like a repo id stays a path, so
  its loader says it does not exist).
* :func:`resolve_checkpoint` — the local directory of a path or a repo id. A repo id is
  looked up in ``huggingface_hub``'s cache (``HF_HUB_CACHE``, else ``HF_HOME/hub``, read
  when called): with the hub reachable it is downloaded there (``snapshot_download``,
  whose progress bars go to stderr), offline (``HF_HUB_OFFLINE=1``, or the hub cannot be
  reached) the cached snapshot is used as it is. A repo id that cannot be had is one
  :class:`~omnirelay.errors.ModelError` line naming it, the cache and what to do.
  ``prefer_cache`` takes a cached snapshot without asking the hub (a stage process
  after the front fetched it).
* :func:`fetch_checkpoint` — a family's ``prepare``: a stage's repo id fetched once in
  the front process, so its stage processes find it in the cache.
* :func:`hub_cache_dir`, :func:`hub_offline` — the cache and the offline switch, from
  the environment at the time of the call.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from omnirelay.errors import ModelError
from omnirelay.models.family import Announce, quiet

__all__ = ["fetch_checkpoint", "hub_cache_dir", "hub_offline", "is_repo_id", "resolve_checkpoint"]

#: ``owner/name``: letters, digits, ``_``, ``-`` and ``.``; each part starts with a letter
#: or digit (so no leading ``/``, ``.`` or ``~``), at most 96 characters, no ``--`` or ``..``.
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}", re.ASCII)
_TRUE = {"1", "on", "yes", "true"}


def is_repo_id(spec: str | os.PathLike[str]) -> bool:
    """Whether ``spec`` names a Hugging Face repo: the ``owner/name`` shape, and no local
    file or directory of that name."""
    text = os.fspath(spec)
    if not _REPO_ID.fullmatch(text) or "--" in text or ".." in text or text.endswith(".git"):
        return False
    return not Path(text).exists()


def hub_cache_dir() -> Path:
    """The hub's model cache, as ``huggingface_hub`` finds it: ``HF_HUB_CACHE`` (or its
    former name ``HUGGINGFACE_HUB_CACHE``), else ``HF_HOME/hub``, else
    ``$XDG_CACHE_HOME/huggingface/hub`` or ``~/.cache/huggingface/hub``."""
    env = os.environ
    explicit = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(os.path.expandvars(explicit)).expanduser()
    home = env.get("HF_HOME") or os.path.join(
        env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface"
    )
    return Path(os.path.expandvars(home)).expanduser() / "hub"


def hub_offline() -> bool:
    """``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) is set to a true value."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().lower() in _TRUE


def resolve_checkpoint(
    spec: str | os.PathLike[str], *, prefer_cache: bool = False, announce: Announce = quiet
) -> Path:
    """The local directory of ``spec`` (see the module docstring): a path as given (``~``
    expanded, not checked: its loader says what is wrong with it), or a repo id's
    snapshot in the hub's cache, downloaded first when the hub is reachable (inside
    ``announce``)."""
    if not is_repo_id(spec):
        return Path(spec).expanduser()
    repo_id = os.fspath(spec)
    cache = hub_cache_dir()
    if prefer_cache or hub_offline():
        cached = _cached_snapshot(repo_id, cache)
        if cached is not None:
            return cached
        if hub_offline():
            raise _not_cached(repo_id, cache, "the hub is off (HF_HUB_OFFLINE is set)")
    with announce(f"fetching {repo_id} from the Hugging Face Hub into {cache}"):
        return _download(repo_id, cache)


def fetch_checkpoint(spec: object, announce: Announce = quiet) -> None:
    """Fetch ``spec`` into the hub's cache now when it is a repo id (nothing otherwise)."""
    if isinstance(spec, str) and spec and is_repo_id(spec):
        resolve_checkpoint(spec, announce=announce)


def _cached_snapshot(repo_id: str, cache: Path) -> Path | None:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, cache_dir=cache, local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError):
        return None
    except Exception as exc:  # an incomplete snapshot, an unreadable cache
        raise ModelError(
            f"the cached snapshot of {repo_id!r} in {cache} cannot be used: {_line(exc)}"
        ) from exc


def _download(repo_id: str, cache: Path) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    login = "log in with `hf auth login` or set HF_TOKEN"
    try:
        return Path(snapshot_download(repo_id, cache_dir=cache))
    except GatedRepoError as exc:
        raise ModelError(
            f"{repo_id!r} is a gated repo on the Hugging Face Hub: accept its terms on its page, then {login}"
        ) from exc
    except RepositoryNotFoundError as exc:
        raise ModelError(
            f"no model {repo_id!r} on the Hugging Face Hub (nor a local directory of that name); "
            f"check the name, or {login} if it is private"
        ) from exc
    except RevisionNotFoundError as exc:
        raise ModelError(f"{repo_id!r} has no main revision on the Hugging Face Hub") from exc
    except LocalEntryNotFoundError as exc:  # the hub could not be reached, and no cached snapshot
        raise _not_cached(repo_id, cache, "the hub cannot be reached") from exc
    except Exception as exc:  # a connection lost mid-download, a full disk …
        cached = _cached_snapshot(repo_id, cache)
        if cached is not None:
            return cached
        raise _not_cached(repo_id, cache, f"downloading it failed ({_line(exc)})") from exc


def _not_cached(repo_id: str, cache: Path, reason: str) -> ModelError:
    return ModelError(
        f"the model {repo_id!r} is not in the Hugging Face cache {cache} and {reason}: pass a local "
        f"checkpoint directory, or run once with network access, or download it first with "
        f"`hf download {repo_id}` (huggingface-cli download {repo_id})"
    )


def _line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
