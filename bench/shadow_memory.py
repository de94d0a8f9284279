"""The driver's memory for a shadowed night's comparison: flat from 1 M to 5 M images.

Per size (``--sizes``), a shadowed night's block files and compacted files in the real layout, then, each
in a process of its own, the driver's part (block reports summed, ``shadow.summarize``) against the whole
night joined in memory as before, by peak RSS. What is built and measured, the target and the JSON keys:
bench/README.md. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402

from bench.support.children import print_result, run_child  # noqa: E402
from bench.support.process_tree import proc_figure  # noqa: E402
from bench.support.results import emit  # noqa: E402
from bench.support.table_reads import predictions_table  # noqa: E402
from rayline.ray_workloads.nightly.blocks import NightOutput, block_contents, write_block_files  # noqa: E402
from rayline.tables.delta_tables import Night  # noqa: E402
from rayline.tables.predictions_table import ERRORS_SCHEMA, PREDICTIONS_SCHEMA  # noqa: E402

MODEL = "photos"
DAY = "2026-12-06"
RUN_ID = "bench-shadow"
KEY = "kbench0000000000"
CLASSES = np.array([f"class-{c:04d}" for c in range(1000)], dtype=object)
TOP_K = 3
PART_ROWS = 100_000  # InferenceConfig.listing_part_objects' default: the blocks' listing parts


def _output(root: str) -> NightOutput:
    tables = [f"{root}/{name}" for name in ("predictions", "prediction_errors", "shadow_predictions")]
    return NightOutput(tables[0], tables[1], Night(MODEL, DAY), RUN_ID, KEY, tables[2])


def _etag(uri: str) -> str:
    return hashlib.md5(uri.encode()).hexdigest()


def _predictions(uris: list[str], index: np.ndarray, rng: np.random.Generator, version: int) -> pa.Table:
    top = np.stack([index, (index + 1) % len(CLASSES), (index + 2) % len(CLASSES)], axis=1)
    probs = np.sort(rng.dirichlet(np.ones(TOP_K), len(uris)), axis=1)[:, ::-1]
    etags = [_etag(u) for u in uris]
    return predictions_table(uris, etags, top, probs, CLASSES, rng.uniform(5, 20, len(uris)), version, "openvino/bf16")


def write_block(output: NightOutput, part: str, start: int, rows: int, rng: np.random.Generator) -> None:
    """One block as an actor writes it: predictions, error rows, and the shadow's rows of the same images."""
    uris = [f"s3://photos/incoming/dt={DAY}/{part}/img-{start + i:08d}.jpg" for i in range(rows)]
    failed = rng.random(rows) < 0.005
    ok = [u for u, f in zip(uris, failed, strict=True) if not f]
    index = rng.integers(0, len(CLASSES), len(ok))
    predictions = _predictions(ok, index, rng, 1)
    bad = [u for u, f in zip(uris, failed, strict=True) if f]
    errors = pa.table(
        {"uri": bad, "stage": ["decode"] * len(bad), "error_type": ["CorruptImageError"] * len(bad),
         "error_message": ["truncated"] * len(bad)},
        schema=ERRORS_SCHEMA,
    )  # fmt: skip
    scored = rng.random(len(ok)) >= 0.01  # the shadow failed on 1 %
    moved = np.where(rng.random(len(ok)) < 0.1, (index + 1) % len(CLASSES), index)
    shadow = _predictions([u for u, s in zip(ok, scored, strict=True) if s], moved[scored], rng, 2)
    contents = block_contents(uris, [_etag(u) for u in uris])
    name = f"{part}/b{start:09d}"
    write_block_files(output, name, predictions, errors, {"CorruptImageError": len(bad)}, contents, None, shadow)


def build(folder: str, images: int, block_rows: int) -> dict[str, Any]:
    """The night's block files and its compacted files; what the driver needs besides (parts, digest)."""
    from rayline.ray_workloads.nightly.compaction import PartBlocks, compact_group

    output = _output(folder)
    rng = np.random.default_rng(images)
    parts = []
    for number, first in enumerate(range(0, images, PART_ROWS)):
        part, rows = f"g{number:05d}-00000", min(PART_ROWS, images - first)
        for start in range(0, rows, block_rows):
            write_block(output, part, start, min(block_rows, rows - start), rng)
        parts.append(PartBlocks(part, rows, min(block_rows, rows)))
    constants = {"code_version": "bench", "flow_run_id": ""}
    files = {
        kind: compact_group(output, kind, parts, 0, PREDICTIONS_SCHEMA, {**constants, "model_version": version})
        for kind, version in (("predictions", 1), ("shadow", 2))
    }
    return {
        "folder": folder,
        "images": images,
        "blocks": [name for p in parts for name in p.names()],
        "files": {kind: f.uri for kind, f in files.items()},
        "shadow_digest": files["shadow"].uris.encode(),
    }


def driver_part(night: dict[str, Any]) -> dict[str, Any]:
    """What the driver does with a shadowed night now: sum the blocks' reports, summarize the counts."""
    from rayline.models.registry import ModelVersion
    from rayline.ray_workloads.nightly.blocks import written_report
    from rayline.ray_workloads.nightly.compaction import NightTotals
    from rayline.ray_workloads.quality.shadow import summarize
    from rayline.storage.digests import SetDigest

    output, baseline = _output(night["folder"]), proc_figure("VmRSS")
    totals = NightTotals()
    for block in night["blocks"]:
        report = written_report(output, block)
        assert report is not None and report.shadow_counts is not None, block
        totals.add(report)
    version = ModelVersion.model_validate(_version_fields())
    inputs = totals.rows["predictions"] + totals.rows["errors"]
    committed = SetDigest.decode(night["shadow_digest"])
    summary = summarize(totals.shadow, committed, version, str(output.shadow_table), inputs)
    return {"baseline_kb": baseline, "agreement": summary.agreement, "compared": summary.compared}


def whole_night_join(night: dict[str, Any]) -> dict[str, Any]:
    """The comparison as the driver made it before: the night's two compacted files joined in memory."""
    import pyarrow.compute as pc

    from rayline import storage

    baseline = proc_figure("VmRSS")
    columns = ["uri", "predicted_class", "confidence"]
    champion = storage.read_parquet([night["files"]["predictions"]], columns=columns)
    shadowed = storage.read_parquet([night["files"]["shadow"]], columns=columns)
    joined = champion.join(shadowed, "uri", right_suffix="_shadow", join_type="inner")
    same = pc.sum(pc.equal(joined["predicted_class"], joined["predicted_class_shadow"])).as_py() or 0
    Counter(str(c) for c in joined["predicted_class"].to_pylist())
    Counter(str(c) for c in joined["predicted_class_shadow"].to_pylist())
    return {"baseline_kb": baseline, "agreement": same / joined.num_rows, "compared": joined.num_rows}


def _version_fields() -> dict[str, Any]:
    return {
        "name": MODEL, "version": 2, "uri": "/r/v2", "weights_uri": "/r/v2/model.pt",
        "model_spec": {"num_classes": len(CLASSES)}, "image_spec": {"crop": 224}, "classes": list(CLASSES),
        "metrics": {}, "data_manifest_uri": "-", "data_content_hash": "-", "code_version": "bench",
        "registered_at": "2026-12-06T00:00:00+00:00",
    }  # fmt: skip


def _measure_in_child(way: str, night_file: Path) -> dict[str, Any]:
    """One measurement in a process of its own: nothing of the build or the other side in its memory."""
    return run_child(way, __file__, ["--measure", way, "--night", str(night_file)])


def _measure(way: str, night_file: str) -> None:
    night = json.loads(Path(night_file).read_text())
    began = time.perf_counter()
    figures = (driver_part if way == "driver" else whole_night_join)(night)
    figures["seconds"] = time.perf_counter() - began
    figures["peak_kb"] = proc_figure("VmHWM")
    print_result(figures)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs=2, default=[1_000_000, 5_000_000])
    parser.add_argument("--block-rows", type=int, default=1_000, help="images per block (actor call)")
    parser.add_argument("--measure", choices=["driver", "join"], help=argparse.SUPPRESS)
    parser.add_argument("--night", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        _measure(args.measure, args.night)
        return
    print(f"{os.cpu_count()} cores; {args.block_rows} images a block", flush=True)
    figures: dict[int, dict[str, dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="rayline-shadow-memory-") as work:
        for images in args.sizes:
            began = time.perf_counter()
            night = build(f"{work}/n{images}", images, args.block_rows)
            night_file = Path(work, f"night-{images}.json")
            night_file.write_text(json.dumps(night))
            print(f"{images:,} images: {len(night['blocks']):,} blocks written and compacted in "
                  f"{time.perf_counter() - began:.0f} s", flush=True)  # fmt: skip
            figures[images] = {way: _measure_in_child(way, night_file) for way in ("driver", "join")}
            driver, join = figures[images]["driver"], figures[images]["join"]
            assert driver["compared"] == join["compared"] and driver["agreement"] == join["agreement"]
            for way, f in figures[images].items():
                print(f"  {way}: peak RSS {f['peak_kb'] / 1024:,.0f} MB (after imports {f['baseline_kb'] / 1024:,.0f} "
                      f"MB), {f['seconds']:.1f} s", flush=True)  # fmt: skip
    small, large = args.sizes
    ratios = {
        f"{way}_rss_ratio": figures[large][way]["peak_kb"] / figures[small][way]["peak_kb"]
        for way in ("driver", "join")
    }
    print(f"peak RSS at {large:,} over {small:,} images: driver {ratios['driver_rss_ratio']:.3f} (target <= 1.25), "
          f"whole-night join {ratios['join_rss_ratio']:.3f}")  # fmt: skip
    result: dict[str, Any] = {**ratios, "small": small, "large": large, "block_rows": args.block_rows}
    for images, ways in figures.items():
        for way, f in ways.items():
            result[f"{way}_peak_mb_{images}"] = round(f["peak_kb"] / 1024, 1)
            result[f"{way}_seconds_{images}"] = round(f["seconds"], 2)
    emit("shadow_memory", result)


if __name__ == "__main__":
    main()
