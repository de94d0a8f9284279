"""What the batch-inference bench prints for a measured pair: rates, cores, ratio, the commit's share."""

from __future__ import annotations

from typing import Any


def rate(figures: dict[str, Any]) -> float:
    return float(figures["runs"][0]["images_s"]) if "runs" in figures else float(figures["images_s"])


def cores(figures: dict[str, Any]) -> str:
    """How many cores the measured side used, and how many the rest of the machine took meanwhile."""
    return f"used {figures['cores']:.2f} cores, other processes {figures['others_cores']:.2f}"


def print_pair(label: str, count: int, plain: dict[str, Any], ray_: dict[str, Any]) -> float:
    first = ray_["runs"][0]
    ratio = first["images_s"] / plain["images_s"]
    print(f"{label}, {count} images:")
    print(
        f"  plain loop   {plain['images_s']:8.1f} images/s ({plain['seconds']:.1f}s, torch threads "
        f"{plain['torch_threads']}; {cores(plain)})"
    )
    print(f"  rayline      {first['images_s']:8.1f} images/s ({first['seconds']:.1f}s; {cores(first)})")
    print(f"    phases (s): {first['phases']}")
    for extra in ray_["runs"][1:]:
        print(
            f"    2nd run in the same job: {extra['images_s']:.1f} images/s ({extra['seconds']:.1f}s; {cores(extra)})"
        )
    waited = f"ray.init {ray_['connect_s']:.1f}s, then {ray_['idle_wait_s']:.1f}s until the cluster was idle"
    print(f"  {waited} (not counted)")
    print(f"  ratio {ratio:.2f}", flush=True)
    return ratio


def commit_share(ray_: dict[str, Any], count: int) -> float:
    """The commit's share of the first night: the driver's own cost of making the night visible."""
    first = ray_["runs"][0]
    share = float(first["phases"]["commit"]) / float(first["elapsed_s"])
    print(
        f"  commit of the night at {count}: {first['phases']['commit']:.2f}s of {first['elapsed_s']:.1f}s "
        f"= {share:.1%} (target <= 10 %)",
        flush=True,
    )
    return share
