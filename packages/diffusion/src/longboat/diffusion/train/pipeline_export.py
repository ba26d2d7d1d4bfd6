"""The export as a whole diffusers pipeline: the trained transformer beside the source
pipeline's VAE, text encoder(s), tokenizer(s) and scheduler.

The source is ``diffusion.pipeline_from`` or, when that is null, ``model.init_from`` when it
is a pipeline directory (it holds ``model_index.json``). The export directory then holds
``transformer/`` (the trained weights, written by the family's ``save_diffusers``), every
other component folder of the source linked (hard links; copied across file systems, so the
export stays whole when the source is deleted) and ``model_index.json`` with the transformer
entry naming the family's class; ``DiffusionPipeline.from_pretrained`` loads it and samples.
``model_index.json`` is written last, so an interrupted export is not a loadable pipeline.
Without a source the export is the transformer directory alone.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from longboat.core.config.errors import ProblemCollector

__all__ = ["MODEL_INDEX", "check_pipeline_source", "pipeline_source", "write_pipeline"]

MODEL_INDEX = "model_index.json"


def pipeline_source(cfg: Any) -> Path | None:
    """The pipeline whose components the export takes: ``diffusion.pipeline_from``, else
    ``model.init_from`` when it is a pipeline directory, else None."""
    given = cfg.diffusion.pipeline_from
    if given:
        return Path(given).expanduser()
    init = cfg.model.init_from
    if init and (Path(init).expanduser() / MODEL_INDEX).is_file():
        return Path(init).expanduser()
    return None


def _components(index: dict[str, Any]) -> dict[str, list[Any]]:
    """The loadable component entries of a ``model_index.json`` (``[library, class]``)."""
    return {
        name: value
        for name, value in index.items()
        if not name.startswith("_")
        and isinstance(value, list)
        and len(value) == 2
        and value[0] is not None
    }


def check_pipeline_source(
    p: ProblemCollector, cfg: Any, diffusers_class: str, latent_channels: int
) -> None:
    """Problems of the export's source pipeline: ``diffusion.pipeline_from`` missing or not a
    pipeline, a transformer of another class, component folders missing, a VAE of another
    latent width than the model's."""
    source = pipeline_source(cfg)
    key = "diffusion.pipeline_from" if cfg.diffusion.pipeline_from else "model.init_from"
    if source is None:
        return
    index_file = source / MODEL_INDEX
    if not index_file.is_file():
        p.add(key, f"holds no {MODEL_INDEX}: not a diffusers pipeline directory",
              value=str(source), fix="point at a pipeline saved by diffusers' save_pretrained")  # fmt: skip
        return
    index = json.loads(index_file.read_text())
    parts = _components(index)
    theirs = parts.get("transformer", [None, None])[1]
    if theirs is not None and theirs != diffusers_class:
        p.add(key, f"is a pipeline of {theirs}, the trained model is a {diffusers_class}",
              value=str(source), fix="name a pipeline of the trained family")  # fmt: skip
    missing = [n for n in parts if n != "transformer" and not (source / n).is_dir()]
    if missing:
        p.add(key, f"lists component folders it does not hold: {', '.join(missing)}",
              value=str(source), fix="point at a complete pipeline directory")  # fmt: skip
    vae_cfg = source / "vae" / "config.json"
    if vae_cfg.is_file():
        vae = json.loads(vae_cfg.read_text())
        width = vae.get("z_dim", vae.get("latent_channels"))
        if width is not None and int(width) != latent_channels:
            p.add(key, f"has a VAE of {width} latent channels, the model takes "
                  f"{latent_channels}", value=str(source),
                  fix="name the pipeline whose VAE encoded the training latents")  # fmt: skip


def _link_tree(src: Path, dst: Path) -> None:
    """``dst`` as a copy of ``src`` made of hard links (copies where linking fails)."""
    if dst.is_symlink() or dst.is_file():
        dst.unlink()
    elif dst.exists():
        shutil.rmtree(dst)
    for path in sorted(src.rglob("*")):
        target = dst / path.relative_to(src)
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(path, target)
        except OSError:  # another file system, or links not allowed
            shutil.copy2(path, target)


def write_pipeline(source: Path, out_dir: Path, diffusers_class: str) -> Path:
    """Complete the export ``out_dir`` (whose ``transformer/`` is written) into a pipeline:
    the source's other components and its ``model_index.json`` naming ``diffusers_class``."""
    index = json.loads((source / MODEL_INDEX).read_text())
    final = out_dir / MODEL_INDEX
    if final.exists():
        final.unlink()  # not loadable until every component is in place
    for name in _components(index):
        if name != "transformer":
            _link_tree(source / name, out_dir / name)
    index["transformer"] = ["diffusers", diffusers_class]
    # an earlier transformer-only export here: its files would shadow the pipeline's
    for stale in [out_dir / "config.json", *out_dir.glob("diffusion_pytorch_model*")]:
        if stale.is_file():
            stale.unlink()
    tmp = out_dir / (MODEL_INDEX + ".tmp")
    tmp.write_text(json.dumps(index, indent=2) + "\n")
    os.replace(tmp, final)
    return out_dir
