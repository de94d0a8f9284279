"""The capacity model of a night: how many nodes of which kind a night of N photos needs by a deadline.

Pure arithmetic over measured per-image costs (``Costs``, measured by
``bench/capacity.py``) and the outside limits (``Limits``); docs/capacity.md
derives it in words. No Ray, no I/O: the same functions predict the 2-node
check of ``bench/capacity.py`` and print the sizing table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from rayline.ray_workloads.nightly.contract import block_size
from rayline.storage.listing import INLINE_OBJECTS, LISTERS


@dataclass(frozen=True)
class Costs:
    """Per-image and per-night costs, on one core of the machine that measured them."""

    fetch_decode_s: float  # read the object + decode + resize/crop to the model's input, one image
    forward_s: float  # the model's forward pass per image, one thread, batches of 32
    write_s: float  # the block files' share of one image (both tables)
    fixed_s: float  # a night's start-up on its cluster: actors, model load, first listing page, commit
    driver_s_per_block: float  # the driver's CPU per block (Ray Data's executor, the report sums)
    compact_s_per_row: float  # CPU to read a block row back and write it into a compacted file
    list_keys_per_s: float  # one listing stream (one S3 LIST page after another)
    commit_s: float  # both tables' Delta commits of one night

    @property
    def cpu_s_per_image(self) -> float:
        return self.fetch_decode_s + self.forward_s + self.write_s


@dataclass(frozen=True)
class Limits:
    """What rayline does not control: the store's, the GPU's and the node shapes' figures."""

    s3_get_per_prefix: float = 5_500.0  # AWS: GET/HEAD requests per second per partitioned prefix
    gpu_img_s: float = 2_000.0  # ASSUMED one GPU's forward rate for the model (an H200's: docs/capacity.md)
    cpu_node_cores: int = 16
    gpu_node_cores: int = 8  # the CPU cores beside the one GPU (decode and writes run on them)
    image_side: int = 224  # the model's input: a compute-bound night's blocks (nightly.contract.block_size)
    prefixes: int = 256  # hashed key prefixes of the bucket (1: a flat prefix)
    prefixes_per_group: int = 8  # rayline.storage.listing.PREFIXES_PER_GROUP: one listing stream per group
    listers: int = LISTERS  # groups a night's cutters list at once
    rows_per_file: int = 100_000  # rayline.ray_workloads.nightly.compaction.MIN_FILE_ROWS


@dataclass(frozen=True)
class NodeKind:
    name: str
    img_s: float  # one node's rate
    bound_by: str  # what sets that rate


def cpu_node(costs: Costs, limits: Limits) -> NodeKind:
    """A CPU node: every core fetches, decodes, runs the model and writes (one single-thread actor a core)."""
    return NodeKind(f"CPU ({limits.cpu_node_cores} cores)", limits.cpu_node_cores / costs.cpu_s_per_image, "cores")


def gpu_node(costs: Costs, limits: Limits) -> NodeKind:
    """A node with one GPU: the GPU runs the model, its CPU cores decode and write; the slower side sets the rate."""
    feed = limits.gpu_node_cores / (costs.fetch_decode_s + costs.write_s)
    bound = "GPU forward pass" if limits.gpu_img_s <= feed else f"decode on its {limits.gpu_node_cores} cores"
    return NodeKind(f"1 GPU + {limits.gpu_node_cores} cores", min(limits.gpu_img_s, feed), bound)


def listing_s(n: int, costs: Costs, limits: Limits) -> float:
    """The listing's seconds: one stream per group of sub-prefixes, ``listers`` at a time (a flat prefix: one)."""
    groups = math.ceil(limits.prefixes / limits.prefixes_per_group)
    streams = max(1, min(limits.listers, groups)) if limits.prefixes > 1 else 1
    return n / (streams * costs.list_keys_per_s)


def serial_listing_s(n: int, costs: Costs, limits: Limits) -> float:
    """The listing's seconds before the first block. A flat prefix is listed whole by the driver first; of a
    prefix with sub-prefixes the driver lists the first ``INLINE_OBJECTS`` (one stream), and the night's
    cutters list the rest while the blocks are predicted (``rayline.storage.listing.begin_listing``)."""
    if limits.prefixes <= 1:
        return listing_s(n, costs, limits)
    return min(n, INLINE_OBJECTS) / costs.list_keys_per_s


@dataclass
class Plan:
    """One night size, one deadline, one node kind: the nodes it needs and each limit's share of the deadline."""

    images: int
    deadline_s: float
    kind: NodeKind
    nodes: int
    compute_s: float  # seconds the nodes have for the images, once the serial parts are taken off
    shares: dict[str, float] = field(default_factory=dict)  # a hard limit's load / its capacity (> 1: infeasible)

    @property
    def bites_first(self) -> str:
        return max(self.shares, key=lambda k: self.shares[k])


def plan(n: int, deadline_s: float, kind: NodeKind, costs: Costs, limits: Limits) -> Plan:
    """Nodes of ``kind`` for ``n`` images within ``deadline_s``, and how close each outside limit comes.

    Serial parts come off the deadline first: start-up, the part of the listing
    that comes before the first block (``serial_listing_s``: all of it for a
    flat prefix), the commit. The rest of the listing runs beside the blocks,
    so it is a limit of its own (its share of the deadline). Compaction runs
    in Ray tasks over the cluster's cores after the last block.
    """
    serial = costs.fixed_s + serial_listing_s(n, costs, limits) + costs.commit_s
    compute_s = deadline_s - serial
    if compute_s <= 0:
        return Plan(n, deadline_s, kind, nodes=0, compute_s=compute_s, shares={"listing": math.inf})
    # compaction's CPU shares the nodes' cores: count it as extra seconds per image
    cores_per_node = limits.cpu_node_cores if kind.name.startswith("CPU") else limits.gpu_node_cores
    per_image_s = 1 / kind.img_s + costs.compact_s_per_row / cores_per_node
    nodes = max(1, math.ceil(n * per_image_s / compute_s))
    gets_s = n / compute_s
    blocks = math.ceil(n / block_size(limits.image_side, n))
    shares = {
        "S3 GET/s per prefix": gets_s / (limits.s3_get_per_prefix * limits.prefixes),
        "listing": listing_s(n, costs, limits) / deadline_s,
        "driver (blocks/s)": blocks * costs.driver_s_per_block / compute_s,
        "Delta commit": costs.commit_s / deadline_s,
    }
    return Plan(n, deadline_s, kind, nodes, compute_s, shares)


def predict_night_s(n: int, workers: int, costs: Costs, objects_per_task: int) -> float:
    """A night of ``n`` images on a cluster of ``workers`` cores running single-thread actors.

    The fixed start-up, then the images' CPU spread over the workers, the
    driver's per-block CPU on the same cores, the listing's part before the
    first block (all of a night under ``INLINE_OBJECTS``) and compaction.
    """
    blocks = math.ceil(n / objects_per_task)
    cpu = n * (costs.cpu_s_per_image + costs.compact_s_per_row) + blocks * costs.driver_s_per_block
    return costs.fixed_s + min(n, INLINE_OBJECTS) / costs.list_keys_per_s + cpu / workers


def files_per_table(n: int, limits: Limits) -> int:
    return max(1, n // limits.rows_per_file)
