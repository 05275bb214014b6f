"""GGUF files converted once into plain Hugging Face folders, cached by the file's content.

transformers loads a GGUF file by dequantizing every tensor (about 12 s for SmolLM2-135M on one
CPU core); a worker that restarts should not pay that again. The first load converts the file
into ``<cache>/<stem>-<sha256[:16]>/`` (config, tokenizer, generation config, weights as
safetensors) and every later load of a file with the same content reads that folder, which
``from_pretrained`` loads in a few seconds.

Invariants: a folder under the cache root without the leading ``.`` is complete (it is written
as ``.NAME.tmp-PID`` and renamed into place in one step, so a crash or a racing worker never
leaves a half-written folder that looks done), and one process at a time converts (a lock on the
cache folder: the others wait for it and then load its result); its name's digest is the content
hash of the GGUF file it came from, so an edited or replaced file converts afresh.

The cache root is ``$TOKENFLEET_MODEL_CACHE``, else ``$XDG_CACHE_HOME/tokenfleet/models``, else
``~/.cache/tokenfleet/models``; ``tokenfleet models clear`` empties it.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from tokenfleet.shared.declared_settings import env_value, setting
from tokenfleet.worker.models.errors import ModelFileError

log = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True, slots=True)
class ModelCacheSettings:
    """Where converted models are cached (read by ``cache_root``). Invariant: none."""

    model_cache: str = setting(
        "",
        env="TOKENFLEET_MODEL_CACHE",
        shown_default="$XDG_CACHE_HOME/tokenfleet/models, else ~/.cache/tokenfleet/models",
        help="folder of the GGUF files converted once into Hugging Face folders, cached by "
        "content (tokenfleet models clear empties it)",
    )


def cache_root(environ: Mapping[str, str] | None = None) -> Path:
    """Where converted models live (see the module docstring)."""
    env = os.environ if environ is None else environ
    configured = env_value(ModelCacheSettings, "model_cache", env)
    if configured:
        return Path(configured).expanduser()
    base = Path(env["XDG_CACHE_HOME"]).expanduser() if env.get("XDG_CACHE_HOME") else None
    return (base or Path.home() / ".cache") / "tokenfleet" / "models"


def file_digest(path: Path) -> str:
    """SHA-256 of ``path``'s content, hex."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def check_gguf(path: Path) -> None:
    """Refuse, naming the file, what is missing or is not a GGUF file at all (cheap: the magic)."""
    if not path.is_file():
        raise ModelFileError(f"model file {path} does not exist")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelFileError(f"{path} is not a GGUF file (it does not start with {GGUF_MAGIC!r})")


def converted_folder(gguf: Path, root: Path | None = None) -> Path:
    """The plain HF folder for ``gguf``, converting it on first use (see the module docstring)."""
    gguf = gguf.resolve()
    check_gguf(gguf)
    root = cache_root() if root is None else root
    digest = file_digest(gguf)
    target = root / f"{gguf.stem}-{digest[:16]}"
    if target.is_dir():
        return target
    root.mkdir(parents=True, exist_ok=True)
    held = os.open(root, os.O_RDONLY)
    try:
        # one conversion at a time per cache: workers started together on a fresh machine
        # convert the file once (the others wait, then load its folder), not once each
        fcntl.flock(held, fcntl.LOCK_EX)
        if target.is_dir():
            return target
        _convert_into(gguf, root, target, digest)
    finally:
        os.close(held)  # (the lock goes with it)
    return target


def _convert_into(gguf: Path, root: Path, target: Path, digest: str) -> None:
    """Convert ``gguf`` into ``target`` through a temporary folder renamed into place."""
    tmp = root / f".{target.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    started = time.monotonic()
    log.info("converting %s into %s (once; later starts load the folder)", gguf, target)
    try:
        _convert(gguf, tmp, digest)
        try:
            os.rename(tmp, target)  # atomic; fails if another process got there first
        except OSError:
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("converted %s in %.1f s", gguf.name, time.monotonic() - started)


def _convert(gguf: Path, out: Path, digest: str) -> None:
    """Dequantize ``gguf`` with transformers and save it as a plain HF folder in ``out``."""
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tokenfleet.worker.engine.quantization import SOURCE_FILE, gguf_linear_types

    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except Exception as exc:  # a truncated or foreign file fails deep inside the GGUF reader
        raise ModelFileError(
            f"{gguf} could not be read as a model: {type(exc).__name__}: {exc}"
        ) from exc
    out.mkdir(parents=True)
    # save_pretrained refuses a model flagged as quantized; the tensors are plain now
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.save_pretrained(out)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    save_model(model, str(out / "model.safetensors"))  # drops the tied lm_head copy
    source = {
        "gguf": str(gguf),
        "sha256": digest,
        "converted_at": time.time(),
        "linear_types": gguf_linear_types(gguf),  # the file's precision: --quantization auto
    }
    (out / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")


def clear(root: Path | None = None) -> list[Path]:
    """Delete every converted folder (and leftovers of interrupted conversions); returns them."""
    root = cache_root() if root is None else root
    if not root.is_dir():
        return []
    removed = sorted(root.iterdir())
    for path in removed:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
    return removed
