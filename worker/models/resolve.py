"""Turn what a user typed after ``--model`` into a folder ``from_pretrained`` can load.

Accepted, in the order they are tried:

* a short name of a bundled model (``smollm2``; see ``catalog.BUNDLED``);
* a ``.gguf`` file, or a folder holding exactly one ``.gguf`` file and no ``config.json``:
  converted once into a cached HF folder (``gguf_cache``);
* a folder with a ``config.json`` (a plain Hugging Face model folder), used as it is;
* a hub id (``org/name``) already in the local Hugging Face cache: nothing is downloaded, and one
  that is not cached fails at once, offline, with the fix named.

Everything else raises ``ModelFileError`` naming what was given. All of this happens before a
worker reads its queue, so a bad model leaves queued work for a healthy worker.
"""

from __future__ import annotations

from pathlib import Path

from tokenfleet.worker.models.catalog import BUNDLED
from tokenfleet.worker.models.errors import ModelFileError
from tokenfleet.worker.models.gguf_cache import converted_folder


def resolve_model(spec: str, *, cache: Path | None = None) -> Path:
    """The local folder to load for ``spec`` (see the module docstring)."""
    spec = spec.strip()
    if not spec:
        raise ModelFileError("no model given: pass --model NAME|FOLDER|FILE.gguf|HUB_ID")
    bundled = BUNDLED.get(spec.lower())
    if bundled is not None:
        return converted_folder(bundled.path(), cache)
    path = Path(spec).expanduser()
    if path.suffix.lower() == ".gguf" or path.is_file():
        return converted_folder(path, cache)
    if path.is_dir():
        return _folder(path, cache)
    if spec.startswith((".", "/", "~")) or spec.count("/") > 1 or "\\" in spec:
        raise ModelFileError(f"model folder {path} does not exist")
    return _cached_hub_id(spec)


def _folder(path: Path, cache: Path | None) -> Path:
    if (path / "config.json").is_file():
        return path
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return converted_folder(ggufs[0], cache)
    if ggufs:
        names = ", ".join(p.name for p in ggufs)
        raise ModelFileError(
            f"model folder {path} holds several GGUF files ({names}): pass one of them"
        )
    raise ModelFileError(
        f"model folder {path} holds neither a config.json (a Hugging Face model) nor a .gguf file"
    )


def _cached_hub_id(spec: str) -> Path:
    from huggingface_hub import snapshot_download

    known = ", ".join(sorted(BUNDLED))
    try:
        return Path(snapshot_download(spec, local_files_only=True))
    except Exception as exc:  # LocalEntryNotFoundError, or an id the hub client refuses
        raise ModelFileError(
            f"model {spec!r} is not a bundled name ({known}), a local folder or file, or a hub "
            "id in the local Hugging Face cache; nothing is downloaded here. Pass a local folder "
            "or .gguf file, or copy the model into the cache (`hf download "
            f"{spec}` on a machine with access to the hub)"
        ) from exc
