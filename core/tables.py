"""The tuned config tables: what core/launch.py's plans read before the heuristic.

A table maps each kernel family's key strings (core/configs.py keys' ``str``) to a
triton.Config. Two sources per GPU, merged, the second winning: the table shipped for the GPU
(core/tuned/<GPU name>.json, written by bench/tune.py) and the user's cache
(``cache_dir()``, written by opt-in autotuning). A broken file is ignored with a warning, never
half-read.
"""

from __future__ import annotations

import json
import os
import re
import threading
import warnings
from pathlib import Path

import torch
import triton

from . import configs

TABLE_DIR = Path(__file__).resolve().parent / "tuned"


def gpu_slug(name: str) -> str:
    """A GPU's name as a file name: 'NVIDIA H200' -> 'NVIDIA_H200'."""
    return re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_")


def cache_dir() -> Path:
    """Where ``onegemm.autotune`` stores what it measures: $ONEGEMM_CACHE_DIR, else
    ~/.cache/onegemm."""
    return Path(os.environ.get("ONEGEMM_CACHE_DIR") or Path.home() / ".cache" / "onegemm")


_tables: dict[int, dict] = {}
_tables_lock = threading.Lock()
_read_shipped = True  # reload_tables(shipped=False): the user's cache alone


def read(path: Path) -> dict:
    """A table file's configs by family and key string ({} for a missing file; a broken one is
    ignored with a warning)."""
    try:
        data = json.loads(path.read_text())
        return {fam: {k: configs.from_json(v) for k, v in entries.items()} for fam, entries in data["configs"].items()}
    except FileNotFoundError:
        return {}
    except (ValueError, KeyError, TypeError) as e:
        warnings.warn(f"onegemm: ignoring the config table {path}: {type(e).__name__}: {e}", stacklevel=3)
        return {}


def _table(device: torch.device) -> dict:
    """The shipped table for the device's GPU merged with the user's cache (which wins)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    table = _tables.get(index)
    if table is None:
        with _tables_lock:
            slug = gpu_slug(torch.cuda.get_device_name(index))
            table = {}
            sources = ([TABLE_DIR / f"{slug}.json"] if _read_shipped else []) + [cache_dir() / f"{slug}.json"]
            for source in sources:
                for fam, entries in read(source).items():
                    table.setdefault(fam, {}).update(entries)
            _tables[index] = table
    return table


def tuned_config(family: str, key: tuple, device: torch.device) -> triton.Config | None:
    """The table's config for ``key`` on ``device``'s GPU, or None."""
    return _table(device).get(family, {}).get(str(key))


def record(family: str, key: tuple, device: torch.device, config: triton.Config) -> None:
    """Add a tuned config to the table in memory and to the user's cache file."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    _table(device).setdefault(family, {})[str(key)] = config
    path = cache_dir() / f"{gpu_slug(torch.cuda.get_device_name(index))}.json"
    with _tables_lock:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            data = json.loads(path.read_text())
        except (FileNotFoundError, ValueError):
            data = {"gpu": torch.cuda.get_device_name(index), "triton": triton.__version__, "configs": {}}
        data["configs"].setdefault(family, {})[str(key)] = configs.to_json(config)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        tmp.replace(path)


def forget(shipped: bool = True) -> None:
    """Drop the tables read so far (the next lookup reads the files again); ``shipped`` False:
    read only the user's cache from now on (core/launch.py ``reload_tables``)."""
    global _read_shipped
    with _tables_lock:
        _tables.clear()
        _read_shipped = shipped
