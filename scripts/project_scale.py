"""How data-parallel THOR scales: a cost model of one training step from 1 to 1,024 replicas,
checked where it can be checked.

The model (DESIGN §3.7 for what is exchanged, README "Distributed training"):

* **Compute per replica** from this machine's measured per-stage costs
  (:func:`thor_tf.profiling.profile_step`: forward + backward, traces, factors, inversion,
  preconditioning; one worker process per model, TF threads pinned to the two cores, medians of
  repeats): each stage's FLOPs are counted from the layer shapes, the fraction of this CPU's
  published peak the stage reached here (``efficiency = FLOPs / (seconds · peak)``) is carried to
  the target device, whose published peak for the stage's precision sets its time
  (``seconds = FLOPs / (efficiency · peak)``), floored by the stage's kernel launches
  (``kernels · launch latency``: a stage of many tiny kernels is launch-bound on a GPU).
  Forward + backward is timed as Keras' fused SGD step; the traces are memory-bound and carried
  by bytes read and memory bandwidth (this CPU's measured) instead of FLOPs and peak.
* **Collectives** by an α-β model of NCCL's ring and tree all-reduce (hierarchical across nodes:
  reduce-scatter over NVLink, all-reduce of a 1/g shard over each GPU's InfiniBand NIC,
  all-gather over NVLink), with NCCL's own per-hop latencies and the published link bandwidths,
  and exactly the bytes per stage that ``scripts/bench_distributed.py`` records (the gradients
  every step, the traces at a cadence point, the factors when some layer refreshes, the inverses
  with ``inverse_assignment="balanced"``; tests/test_project_scale.py checks them at R = 1, 2, 4).
* **Refresh fraction** per layer from the measured trace-rule runs
  (``docs/results/bench_trace_rule_{cnn,resnet20}.json``, setting ``thor``: refreshes / cadence points);
  ResNet-50 has no measured run and borrows ResNet-20's mean fraction (said where it is used).
* **Steps** (per replica, weak scaling: the per-replica batch is fixed): SGD-momentum; THOR's
  plain step (preconditioning only); cadence step (+ traces); refresh step (every layer refreshes:
  + factors, their exchange, inversion under ``inverse_assignment`` "all" / "balanced" (a layer is
  the unit) / "blocks" (per-block longest-processing-time, :func:`thor_tf.distributed.
  balanced_block_owners`; not in the engine yet), the inverses' exchange); amortized step at
  ``frequency`` with the measured refresh fractions (expected inversion load by Monte Carlo over
  which layers refresh, independent per layer).

Checks: (1) on this machine at R = 1, 2, 4 logical CPU devices (the replicas share the two cores:
replicated work costs R times, collectives are measured here with the α-β fit of a
MirroredStrategy all-reduce) against ``docs/results/bench_distributed.json``'s recorded step times; (2)
against MindSpore's published ResNet-50 per-step times on 8 devices (THOR 20.4 ms at batch 32 per
Ascend 910, SGD 118 ms at batch 256; THOR 76 ms at batch 32 on 8 V100).

What it cannot capture: efficiencies on a GPU differ from this CPU's per op type (the transfer
assumes they are the same fraction of peak; the MindSpore check measures how wrong that is);
overlap of the gradient all-reduce with the backward pass (TF/Keras' all-reduce runs after it, for
SGD and THOR alike: not modelled); input pipelines, host overhead, stragglers, network contention
across jobs, memory (``"all"`` keeps every inverse on every replica either way); XLA fusion
(changes kernel counts); the accuracy side (steps to target, in the README's runs).

    python scripts/project_scale.py --out docs/results/project_scale.json          # ~4 minutes here
    python scripts/project_scale.py --check-models cnn,resnet20 --out docs/results/project_scale.json  # ~11
    python scripts/project_scale.py --no-measure --out docs/results/project_scale.json   # re-project only
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import time

from experiments.worker import report, run_self  # noqa: E402

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KIB = 1024

# ------------------------------------------------------------------------ published figures


@dataclasses.dataclass(frozen=True)
class Device:
    """One accelerator (or this CPU). ``peak``: FLOP/s by precision: ``"fp32"`` (plain float32
    units: Cholesky, reductions), ``"matrix32"`` (float32 matmuls: TF32 tensor cores where TF uses
    them, Ampere and later), ``"half"`` (fp16/bf16 tensor units: forward + backward under mixed
    precision). ``memory_bw`` bytes/s; ``launch_s`` seconds per kernel launch."""

    name: str
    peak: dict
    memory_bw: float
    launch_s: float
    source: str


# The kernel-launch floor: NVIDIA's "Getting Started with CUDA Graphs" (developer.nvidia.com/blog/
# cuda-graphs) measures ~3.8 us per short kernel launched back to back from a stream; TF's executor
# adds its own per-op cost on top (not published; 0 and 10 us are the sensitivity run).
CUDA_LAUNCH_S = 4e-6

DEVICES = {
    # This machine: AMD EPYC (family 25 model 17, Zen 4), 2 vCPUs at 2.6 GHz (/proc/cpuinfo). Zen 4
    # executes AVX-512 on two 256-bit FMA pipes: 2 x 8 fp32 FMA = 32 FLOP per cycle per core (AMD,
    # "Software Optimization Guide for the AMD Zen 4 Microarchitecture"). TF runs everything in fp32.
    # Its memory bandwidth is not published for a 2-vCPU slice: measured by the script (a NumPy
    # copy, replacing this placeholder).
    "cpu_here": Device("this CPU (2 cores)", {p: 2 * 2.6e9 * 32 for p in ("fp32", "matrix32", "half")},
                       memory_bw=10e9, launch_s=0.0, source="/proc/cpuinfo; AMD Zen 4 optimization guide"),
    # NVIDIA V100 SXM2 datasheet: 15.7 TFLOPS fp32, 125 TFLOPS tensor (fp16), HBM2 900 GB/s.
    # Volta has no TF32: float32 matmuls run on the fp32 units.
    "v100": Device("V100 SXM2", {"fp32": 15.7e12, "matrix32": 15.7e12, "half": 125e12},
                   memory_bw=900e9, launch_s=CUDA_LAUNCH_S, source="NVIDIA V100 datasheet"),
    # NVIDIA A100 SXM4 datasheet: 19.5 TFLOPS fp32, 156 TFLOPS TF32, 312 TFLOPS fp16/bf16 (dense),
    # HBM2e 2,039 GB/s (80 GB).
    "a100": Device("A100 SXM4", {"fp32": 19.5e12, "matrix32": 156e12, "half": 312e12},
                   memory_bw=2039e9, launch_s=CUDA_LAUNCH_S, source="NVIDIA A100 datasheet"),
    # NVIDIA H100 SXM5 datasheet: 67 TFLOPS fp32, 494.7 TFLOPS TF32, 989.4 TFLOPS bf16 (dense, i.e.
    # half the "with sparsity" figures), HBM3 3.35 TB/s.
    "h100": Device("H100 SXM5", {"fp32": 67e12, "matrix32": 494.7e12, "half": 989.4e12},
                   memory_bw=3.35e12, launch_s=CUDA_LAUNCH_S, source="NVIDIA H100 datasheet"),
    # Huawei Ascend 910 (Hot Chips 31, 2019): 256 TFLOPS fp16 on the Cube units, HBM 1.2 TB/s.
    # MindSpore's THOR computes factors and inverses on the Cube in fp16, so "matrix32" is the fp16
    # peak; "fp32" (the vector units) is not published: 1/16 of the Cube is an assumption.
    "ascend910": Device("Ascend 910", {"fp32": 16e12, "matrix32": 256e12, "half": 256e12},
                        memory_bw=1.2e12, launch_s=CUDA_LAUNCH_S,
                        source="Huawei, Hot Chips 31 (2019); fp32 figure assumed"),
}


@dataclasses.dataclass(frozen=True)
class Link:
    """One level of the interconnect: ``bandwidth`` bytes/s per device per direction (what one
    device can push while all push), ``hop_s`` the per-hop latency by NCCL protocol (``"ll"`` for
    small messages, ``"simple"`` for large)."""

    name: str
    bandwidth: float
    hop_s: dict
    source: str


# NCCL's tuning model (NVIDIA/nccl src/graph/tuning.cc, hwLat / baseLat, ring): per-hop latency
# NVLink 0.47 us (LL) / 3.4 us (Simple), network 2.7 us / 9.6 us; base latency per collective
# 3.6 us / 8.4 us. NCCL caps A100 NVLink bus bandwidth at 235 GB/s of the 300 GB/s per direction
# (same file): the 0.78 below applies that ratio to every link's published figure.
NCCL_BASE_S = {"ll": 3.6e-6, "simple": 8.4e-6}
NVLINK_HOP = {"ll": 0.47e-6, "simple": 3.4e-6}
NET_HOP = {"ll": 2.7e-6, "simple": 9.6e-6}
LINK_EFFICIENCY = 235.0 / 300.0
LL_THRESHOLD = 64 * KIB  # below this NCCL picks its low-latency protocol

LINKS = {
    # NVLink 2 (V100 SXM2): 6 links x 25 GB/s per direction = 150 GB/s ("300 GB/s" bidirectional).
    "nvlink2": Link("NVLink 2", 150e9 * LINK_EFFICIENCY, NVLINK_HOP, "NVIDIA V100 datasheet"),
    # NVLink 3 (A100): 12 links x 25 GB/s = 300 GB/s per direction ("600 GB/s").
    "nvlink3": Link("NVLink 3", 300e9 * LINK_EFFICIENCY, NVLINK_HOP, "NVIDIA A100 datasheet"),
    # NVLink 4 (H100 SXM5): 18 links x 25 GB/s = 450 GB/s per direction ("900 GB/s").
    "nvlink4": Link("NVLink 4", 450e9 * LINK_EFFICIENCY, NVLINK_HOP, "NVIDIA H100 datasheet"),
    # Ascend 910: three HCCS ports of 240 Gb/s (30 GB/s); a ring uses one per direction.
    "hccs": Link("HCCS", 30e9 * LINK_EFFICIENCY, NVLINK_HOP, "Huawei, Hot Chips 31 (2019)"),
    # InfiniBand per GPU: DGX-1 has 4 EDR (100 Gb/s) NICs for 8 V100: 6.25 GB/s each;
    # DGX A100 8 HDR (200 Gb/s) NICs: 25 GB/s; DGX H100 8 NDR (400 Gb/s): 50 GB/s (NVIDIA DGX
    # user guides); Ascend 910 servers: RoCE 100 Gb/s per chip (Hot Chips 31).
    "edr_half": Link("IB EDR, 1 NIC per 2 GPUs", 6.25e9 * LINK_EFFICIENCY, NET_HOP, "NVIDIA DGX-1"),
    "hdr": Link("IB HDR 200 Gb/s per GPU", 25e9 * LINK_EFFICIENCY, NET_HOP, "NVIDIA DGX A100"),
    "ndr": Link("IB NDR 400 Gb/s per GPU", 50e9 * LINK_EFFICIENCY, NET_HOP, "NVIDIA DGX H100"),
    "roce100": Link("RoCE 100 Gb/s per chip", 12.5e9 * LINK_EFFICIENCY, NET_HOP, "Hot Chips 31"),
}


@dataclasses.dataclass(frozen=True)
class Cluster:
    """Nodes of ``per_node`` devices on ``intra`` links, nodes joined by ``inter``.
    ``shared_compute``: the replicas share one device's cores (logical CPU devices here), so work
    done on every replica costs R times; ``measured_allreduce``: ``{R: (alpha_s, bytes_per_s)}``
    fitted here instead of the α-β link model."""

    name: str
    device: Device
    per_node: int
    intra: Link | None
    inter: Link | None
    shared_compute: bool = False
    measured_allreduce: dict | None = None


CLUSTERS = {
    "dgx-h100": Cluster("DGX H100 (8x H100, NVLink 4, NDR IB)", DEVICES["h100"], 8,
                        LINKS["nvlink4"], LINKS["ndr"]),
    "dgx-a100": Cluster("DGX A100 (8x A100, NVLink 3, HDR IB)", DEVICES["a100"], 8,
                        LINKS["nvlink3"], LINKS["hdr"]),
    "dgx1-v100": Cluster("DGX-1 (8x V100, NVLink 2, EDR IB)", DEVICES["v100"], 8,
                         LINKS["nvlink2"], LINKS["edr_half"]),
    "ascend910": Cluster("Ascend 910 server (8 chips, HCCS, RoCE)", DEVICES["ascend910"], 8,
                         LINKS["hccs"], LINKS["roce100"]),
}

#: The precision a stage runs in on an accelerator (forward + backward in mixed precision, as
#: ImageNet runs are trained; THOR's curvature in float32, DESIGN §6); ``"memory"``: a stage
#: bound by memory traffic (the traces: sums of squares over the im2col patches, a few FLOPs per
#: byte), counted in bytes and carried by memory bandwidth instead of FLOP peak.
STAGE_PRECISION = {"forward_backward": "half", "traces": "memory", "factors": "matrix32",
                   "inversion": "fp32", "precondition": "matrix32"}

#: Kernels per block and stage (estimates from the engine's ops, for the launch floor): the
#: preconditioning is two batched matmuls with reshapes and scaling; traces two reductions; factors
#: the patches, two batched Grams and scaling; an inversion one pad-gather-Cholesky-solve-scatter
#: per size bucket (or per layer where each layer is inverted apart).
KERNELS = {"precondition": 6, "traces": 4, "factors": 8, "inversion": 10, "per_keras_layer": 3}

# ------------------------------------------------------------------------ model shapes


@dataclasses.dataclass(frozen=True)
class LayerShape:
    """One THOR block. ``in_dim``: the kernel's rows (kh·kw·Cin or Din); ``a_dim = in_dim + bias``
    (the bias folded into A); ``g_dim``: outputs; ``positions``: rows per example (Ho·Wo for
    Conv2D, 1 for Dense on ``[N, D]``); ``input_size``: elements of its input per example
    (Hin·Win·Cin; what tr(A) reads: the engine sums squares under each receptive field with a
    ones-kernel convolution, no patches formed); ``first``: its input is the model's (no input
    gradient)."""

    name: str
    kind: str
    in_dim: int
    bias: bool
    g_dim: int
    positions: int
    input_size: int
    first: bool = False

    @property
    def a_dim(self):
        return self.in_dim + int(self.bias)


@dataclasses.dataclass
class ModelShape:
    """A model as the cost model sees it: its THOR blocks, trainable parameters, Keras layers that
    compute (for the launch floor) and trainable variables (one update kernel each)."""

    name: str
    layers: list
    parameters: int
    keras_layers: int
    variables: int


def split_layout(dim, split_dim):
    """``(blocks, size)`` of a ``dim`` factor cut at ``split_dim`` (the last block padded; one exact
    block when ``split_dim >= dim``): the engine's layout, restated here from DESIGN §2."""
    if split_dim >= dim:
        return 1, dim
    return -(-dim // split_dim), split_dim


def model_shape(model, name=None):
    """The :class:`ModelShape` of a built Keras model: Conv2D (groups 1) and Dense layers are
    blocks (the model zoo's only block types), every trainable variable counts."""
    import keras

    layers, keras_layers = [], 0
    first_input = model.inputs[0] if model.inputs else None
    for layer in model._flatten_layers(include_self=False, recursive=True):
        if isinstance(layer, keras.layers.InputLayer):
            continue
        keras_layers += 1
        first = first_input is not None and layer.input is first_input
        bias = getattr(layer, "bias", None) is not None
        if isinstance(layer, keras.layers.Conv2D) and layer.groups == 1:
            kh, kw, cin, cout = (int(d) for d in layer.kernel.shape)
            _, ho, wo, _ = layer.output.shape
            size = math.prod(int(d) for d in layer.input.shape[1:])
            layers.append(LayerShape(layer.name, "conv2d", kh * kw * cin, bias, cout,
                                     int(ho) * int(wo), size, first))
        elif isinstance(layer, keras.layers.Dense):
            din, dout = (int(d) for d in layer.kernel.shape)
            positions = math.prod(int(d) for d in layer.input.shape[1:-1])
            layers.append(LayerShape(layer.name, "dense", din, bias, dout, positions,
                                     positions * din, first))
    parameters = sum(math.prod(int(d) for d in v.shape) for v in model.trainable_variables)
    return ModelShape(name or model.name, layers, parameters, keras_layers,
                      len(model.trainable_variables))


def build_model(name, input_shape=None, classes=None):
    """A model of the zoo (``experiments.models``) at its projection input."""
    from experiments import models

    shape, default_classes = PROJECTED_INPUTS[name]
    return models.build(name, input_shape or shape, classes or default_classes)


#: Inputs the projections use (ImageNet for ResNet-50, CIFAR for ResNet-20, MNIST for the CNN).
PROJECTED_INPUTS = {"cnn": ((28, 28, 1), 10), "resnet20": ((32, 32, 3), 10),
                    "resnet50": ((224, 224, 3), 1000)}
#: Inputs measured on this CPU (bench_distributed's for the CNN and ResNet-20; ResNet-50 at 64x64,
#: batch 16, so a profile fits in a minute).
MEASURED = {"cnn": ((28, 28, 1), 10, 128), "resnet20": ((32, 32, 1), 10, 128),
            "resnet50": ((64, 64, 3), 1000, 16)}

# ------------------------------------------------------------------------ bytes and FLOPs


def factor_floats(shape, split_dim):
    """Floats of every block's A and G diagonal blocks: ``Σ_l nb_A·d_A² + nb_G·d_G²``."""
    total = 0
    for layer in shape.layers:
        for dim in (layer.a_dim, layer.g_dim):
            nb, d = split_layout(dim, split_dim)
            total += nb * d * d
    return total


def collective_bytes(shape, replicas, split_dim):
    """Bytes each replica hands to a collective, per stage (DESIGN §3.7, README table): the
    gradients (+ the loss) every step, the traces ``[tr A, tr G]`` of every block (+ the batch
    weight) at a cadence point, the factor blocks (+ the weight) when some layer refreshes, the
    inverses with ``inverse_assignment="balanced"``. Nothing on one replica."""
    if replicas <= 1:
        return {"gradients": 0, "traces": 0, "factors": 0, "inverses": 0}
    floats = factor_floats(shape, split_dim)
    return {"gradients": 4 * (shape.parameters + 1), "traces": 4 * (2 * len(shape.layers) + 1),
            "factors": 4 * (floats + 1), "inverses": 4 * floats}


def layer_flops(layer, batch, split_dim):
    """FLOPs of one block's stages for ``batch`` examples (a multiply-add is 2 FLOPs).

    forward + backward: ``2·N·P·in·g`` forward, as much for the kernel gradient and for the input
    gradient (none for the first layer); traces: sums of squares of the layer's input and of g (in
    bytes read: memory-bound);
    factors: only the diagonal blocks, ``nb·d²`` multiply-adds per row and factor; inversion:
    Cholesky ``d³/3`` + solve against the identity ``2·d³`` per block; preconditioning:
    ``G_inv·∇W·A_inv`` with block-diagonal inverses, ``(nb_A·d_A²·g + nb_G·d_G²·a)`` multiply-adds.
    """
    rows = batch * layer.positions
    nb_a, d_a = split_layout(layer.a_dim, split_dim)
    nb_g, d_g = split_layout(layer.g_dim, split_dim)
    forward = 2 * rows * layer.in_dim * layer.g_dim
    return {
        "forward_backward": forward * (2 if layer.first else 3),
        "traces": 4 * (batch * layer.input_size + rows * layer.g_dim),  # bytes read: x and g
        "factors": 2 * rows * (nb_a * d_a * d_a + nb_g * d_g * d_g),
        "inversion": 7.0 / 3.0 * (nb_a * d_a ** 3 + nb_g * d_g ** 3),
        "precondition": 2 * (nb_a * d_a * d_a * layer.g_dim + nb_g * d_g * d_g * layer.a_dim),
    }


def model_flops(shape, batch, split_dim):
    """``{stage: [FLOPs per layer]}`` for ``batch`` examples."""
    per_layer = [layer_flops(layer, batch, split_dim) for layer in shape.layers]
    return {stage: [f[stage] for f in per_layer] for stage in STAGE_PRECISION}


def size_buckets(sizes, ratio=0.75):
    """How many batched inversions the engine runs for these block sizes
    (thor_tf.buckets.size_buckets: sizes within 0.75x of a larger one share its batch)."""
    left, count = sorted(set(sizes), reverse=True), 0
    while left:
        count += 1
        left = [d for d in left if d < ratio * left[0]]
    return count


def block_costs(shape, split_dim):
    """Per layer, the inversion cost ``d³`` of each of its diagonal blocks (A's, then G's)."""
    out = []
    for layer in shape.layers:
        costs = []
        for dim in (layer.a_dim, layer.g_dim):
            nb, d = split_layout(dim, split_dim)
            costs.extend([float(d) ** 3] * nb)
        out.append(costs)
    return out


# ------------------------------------------------------------------------ collectives


def allreduce_seconds(nbytes, replicas, cluster, algorithm="best"):
    """α-β time of an all-reduce of ``nbytes`` over ``replicas`` devices.

    One node (``replicas <= per_node``): a ring, ``2(R−1)`` hops and ``2(R−1)/R·n`` bytes per device.
    Across nodes (g per node, N nodes): reduce-scatter in the node, an all-reduce of the ``n/g``
    shard between nodes over each device's own NIC (ring: ``2(N−1)`` hops, ``2(N−1)/N·n/g`` bytes;
    tree: ``2·log2 N`` hops, ``2·n/g`` bytes), all-gather in the node. ``"best"``: the faster, as
    NCCL's tuner picks. Small messages use NCCL's low-latency protocol's hop latency.
    """
    if replicas <= 1 or nbytes <= 0:
        return 0.0
    if cluster.measured_allreduce is not None:
        alpha, beta = cluster.measured_allreduce[int(replicas)]
        return alpha + nbytes / beta
    proto = "ll" if nbytes < LL_THRESHOLD else "simple"
    base = NCCL_BASE_S[proto]
    g = min(int(replicas), cluster.per_node)
    nodes = -(-int(replicas) // g)
    intra_half = (g - 1) * cluster.intra.hop_s[proto] + (g - 1) / g * nbytes / cluster.intra.bandwidth
    if nodes == 1:
        return base + 2 * intra_half
    shard = nbytes / g
    hop = cluster.inter.hop_s[proto]
    ring = 2 * (nodes - 1) * hop + 2 * (nodes - 1) / nodes * shard / cluster.inter.bandwidth
    tree = 2 * math.ceil(math.log2(nodes)) * hop + 2 * shard / cluster.inter.bandwidth
    inter = {"ring": ring, "tree": tree, "best": min(ring, tree)}[algorithm]
    return base + 2 * intra_half + inter


# ------------------------------------------------------------------------ the step model


@dataclasses.dataclass
class Costs:
    """What a projection needs of one model at one per-replica batch: FLOPs per stage and layer,
    the efficiencies measured here, bytes, block costs, refresh fractions."""

    shape: ModelShape
    batch: int
    split_dim: int
    flops: dict
    efficiency: dict
    refresh_fraction: list

    def __post_init__(self):
        self.block_costs = block_costs(self.shape, self.split_dim)


def stage_seconds(flops, kernels, stage, device, efficiency):
    """Seconds of one stage on ``device``: FLOPs at the measured fraction of the stage's peak,
    floored by its kernel launches."""
    if flops <= 0 and kernels <= 0:
        return 0.0
    precision = STAGE_PRECISION[stage]
    peak = device.memory_bw if precision == "memory" else device.peak[precision]
    compute = flops / (efficiency[stage] * peak)
    return max(compute, kernels * device.launch_s)


_OWNERS = {}


def owners(costs, replicas, unit):
    """Owners by the engine's ``"balanced"`` (``unit="layer"``: longest-processing-time over
    layers, cost Σ d³ of their blocks) or per block (``unit="block"``: over all blocks of all
    layers); cached (the Monte Carlo asks often)."""
    from thor_tf.distributed import balanced_block_owners, balanced_owners

    key = (unit, int(replicas), tuple(tuple(c) for c in costs))
    if key not in _OWNERS:
        _OWNERS[key] = (balanced_owners([sum(c) for c in costs], replicas) if unit == "layer"
                        else balanced_block_owners(costs, replicas))
    return _OWNERS[key]


def inversion_seconds(c, device, replicas, assignment, refreshing, shared=False):
    """Seconds of the inversion at a refresh where ``refreshing[l]`` layers refresh.

    ``"all"``: every replica inverts every refreshing block (one batched inversion per size
    bucket); ``"balanced"``: each refreshing layer on its owner (a layer's inversion apart);
    ``"blocks"``: each block on its owner (one batched inversion per bucket and replica). On a
    device the slowest replica sets the time; on shared cores (``shared``) the replicas' work adds.
    """
    costs = c.block_costs
    flops_per_d3 = 7.0 / 3.0
    sizes = lambda layer: [split_layout(d, c.split_dim)[1] for d in (layer.a_dim, layer.g_dim)]
    if assignment == "all" or replicas <= 1:
        active = [l for l, on in zip(c.shape.layers, refreshing) if on]
        flops = sum(flops_per_d3 * sum(costs[i]) for i, on in enumerate(refreshing) if on)
        buckets = size_buckets([d for l in active for d in sizes(l)]) if active else 0
        one = stage_seconds(flops, buckets * KERNELS["inversion"], "inversion", device,
                            c.efficiency)
        return one * (replicas if shared else 1)
    loads = [0.0] * replicas
    kernels = [0] * replicas
    if assignment == "balanced":
        for i, owner in enumerate(owners(costs, replicas, "layer")):
            if refreshing[i]:
                loads[owner] += flops_per_d3 * sum(costs[i])
                kernels[owner] += KERNELS["inversion"]
    else:  # "blocks"
        owned_sizes = [set() for _ in range(replicas)]
        for i, per_block in enumerate(owners(costs, replicas, "block")):
            if not refreshing[i]:
                continue
            for cost, owner in zip(costs[i], per_block):
                loads[owner] += flops_per_d3 * cost
                owned_sizes[owner].add(round(cost ** (1 / 3)))
        kernels = [size_buckets(s) * KERNELS["inversion"] if s else 0 for s in owned_sizes]
    times = [stage_seconds(f, k, "inversion", device, c.efficiency) for f, k in zip(loads, kernels)]
    return sum(times) if shared else max(times)


def expected_inversion_seconds(c, device, replicas, assignment, samples=256, seed=0):
    """Mean inversion seconds at a cadence point where layer l refreshes with probability
    ``refresh_fraction[l]`` (independently; Monte Carlo, fixed seed)."""
    import random

    rng = random.Random(seed)
    total, fired = 0.0, 0
    for _ in range(samples):
        refreshing = [rng.random() < f for f in c.refresh_fraction]
        if any(refreshing):
            fired += 1
            total += inversion_seconds(c, device, replicas, assignment, refreshing)
    return total / samples, fired / samples


def step_times(c, cluster, replicas, assignment="all", frequency=10, algorithm="best"):
    """Seconds per step at ``replicas`` replicas, with the parts (see the module docstring).

    Returns ``{"sgd", "plain", "cadence", "refresh", "amortized": seconds, "parts": {part:
    seconds of the amortized THOR step}, "sgd_parts": {...}, "p_any": P(some layer refreshes)}``.
    """
    device, shared = cluster.device, cluster.shared_compute
    r = int(replicas)
    L = len(c.shape.layers)
    n_bytes = collective_bytes(c.shape, r, c.split_dim)
    ar = {k: allreduce_seconds(v, r, cluster, algorithm) for k, v in n_bytes.items()}
    total = {stage: sum(v) for stage, v in c.flops.items()}
    fb_kernels = KERNELS["per_keras_layer"] * c.shape.keras_layers
    # On shared cores the batch-proportional stages of all replicas together cost what one device
    # pays for the global batch (c.flops is per replica: times R); replicated work costs R times.
    scale = r if shared else 1
    repl = r if shared else 1
    fb = stage_seconds(total["forward_backward"] * scale, fb_kernels, "forward_backward", device,
                       c.efficiency)
    update = 5 * 4 * c.shape.parameters / device.memory_bw  # read w, g, v; write w, v
    update = max(update, c.shape.variables * device.launch_s) * repl
    precondition = repl * stage_seconds(total["precondition"], KERNELS["precondition"] * L,
                                        "precondition", device, c.efficiency)
    traces = stage_seconds(total["traces"] * scale, KERNELS["traces"] * L, "traces", device,
                           c.efficiency)
    factors_all = stage_seconds(total["factors"] * scale, KERNELS["factors"] * L, "factors",
                                device, c.efficiency)
    inverse_all = inversion_seconds(c, device, r, assignment, [True] * L, shared)
    shares_inverses = assignment != "all" and r > 1
    sgd_parts = {"forward_backward": fb, "update": update, "gradient_allreduce": ar["gradients"]}
    sgd = sum(sgd_parts.values())
    plain = sgd + precondition
    cadence = plain + traces + ar["traces"]
    refresh = (cadence + factors_all + ar["factors"] + inverse_all
               + (ar["inverses"] if shares_inverses else 0.0))
    # Amortized: one cadence point every `frequency` steps; layer l refreshes at a fraction f_l
    # of them; the factor (and inverse) exchange runs when any layer refreshes.
    if shared:
        e_inverse = inverse_all * sum(c.refresh_fraction) / max(L, 1)
        p_any = 1.0 - math.prod(1.0 - f for f in c.refresh_fraction)
    else:
        e_inverse, p_any = expected_inversion_seconds(c, device, r, assignment)
    e_factor_flops = sum(f * x for f, x in zip(c.refresh_fraction, c.flops["factors"]))
    e_factors = stage_seconds(e_factor_flops * scale,
                              KERNELS["factors"] * sum(c.refresh_fraction), "factors", device,
                              c.efficiency)
    parts = dict(sgd_parts)
    parts.update({
        "precondition": precondition,
        "traces": (traces + ar["traces"]) / frequency,
        "factors": e_factors / frequency,
        "factor_allreduce": p_any * ar["factors"] / frequency,
        "inversion": e_inverse / frequency,
        "inverse_allreduce": (p_any * ar["inverses"] / frequency) if shares_inverses else 0.0,
    })
    return {"sgd": sgd, "plain": plain, "cadence": cadence, "refresh": refresh,
            "amortized": sum(parts.values()), "parts": parts, "sgd_parts": sgd_parts,
            "p_any": p_any, "bytes": n_bytes}


# ------------------------------------------------------------------------ measurements here


def _pin_threads(tf):
    """Two intra-op and two inter-op threads (the machine's cores; TF's own choice here, stated so
    that a bigger machine measures the same way). One inter-op thread made Keras' CNN step 1.8x
    slower than bench_distributed's unpinned one: the check must time both alike."""
    tf.config.threading.set_intra_op_parallelism_threads(2)
    tf.config.threading.set_inter_op_parallelism_threads(2)


def profile_worker(name, repeats, sgd_steps):
    """Per-stage seconds of a THOR step (``profile_step``) and Keras SGD-momentum's ``fit`` step
    (MirroredStrategy on one device, as bench_distributed's R = 1 row) for the measured input."""
    import numpy as np
    import tensorflow as tf

    _pin_threads(tf)
    import keras
    import thor_tf
    from thor_tf.profiling import profile_step
    from experiments import models
    from experiments.timing import fit_step_seconds

    shape, classes, batch = MEASURED[name]
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch, *shape)).astype("float32")
    y = rng.integers(0, classes, size=batch)
    keras.utils.set_random_seed(0)
    # The inverse rule: the model counts its Cholesky FLOPs and exchanges its inverses, and
    # profile_step times the refresh of the rule the model trains with.
    wrapped = thor_tf.wrap(models.build(name, shape, classes), update_rule="inverse",
                           learning_rate=0.01, verbose=False)
    wrapped.compile(loss="sparse_categorical_crossentropy")
    profile = profile_step(wrapped, x, y, repeats=repeats)
    out = {"model": name, "input": list(shape), "batch": batch, "profile": profile,
           "split_dim": int(wrapped.thor_optimizer.split_dim),
           "blocks": [b.name for b in wrapped.thor.blocks]}
    if sgd_steps:
        strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
        with strategy.scope():
            keras.utils.set_random_seed(0)
            sgd = models.build(name, shape, classes)
            sgd.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
                        loss="sparse_categorical_crossentropy")
        data = tf.data.Dataset.from_tensors((x, y)).repeat()
        out["sgd_step_s"], _ = fit_step_seconds(sgd, data, sgd_steps)
    return out


def collective_worker(replicas, repeats):
    """α (s) and β (bytes/s) of a MirroredStrategy SUM all-reduce over ``replicas`` logical CPU
    devices, least squares over 4 B … 4 MB, less a strategy.run without the collective."""
    import numpy as np
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * replicas)
    _pin_threads(tf)
    strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(replicas)])

    def timed(fn):
        fn()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            [t.numpy() for t in strategy.experimental_local_results(fn())]
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    sizes, seconds = [], []
    for floats in (1, 16384, 262144, 1048576):
        value = tf.ones([floats])

        @tf.function
        def reduce():
            ctx = lambda: tf.distribute.get_replica_context().all_reduce("sum", value * 1.0)
            return strategy.run(ctx)

        @tf.function
        def baseline():
            return strategy.run(lambda: value * 1.0)

        sizes.append(4 * floats)
        seconds.append(max(timed(reduce) - timed(baseline), 0.0))
    slope, alpha = np.polyfit(np.array(sizes, float), np.array(seconds), 1)
    return {"replicas": replicas, "bytes": sizes, "seconds": seconds,
            "alpha_s": float(max(alpha, 0.0)), "bytes_per_s": float(1.0 / max(slope, 1e-15))}


def memory_bandwidth(megabytes=256, repeats=7):
    """This CPU's memory bandwidth (bytes/s): a NumPy copy of a buffer far larger than the caches
    (read + write), median of repeats."""
    import numpy as np

    a = np.ones(megabytes * 2 ** 20 // 4, np.float32)
    b = np.empty_like(a)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(b, a)
        times.append(time.perf_counter() - start)
    return 2 * a.nbytes / statistics.median(times)


def measure(args):
    """Run the workers (fresh processes), with progress."""
    out = {"profiles": {}, "collectives": {}, "cpu_memory_bw": memory_bandwidth()}
    print(f"[measure] memory bandwidth {out['cpu_memory_bw'] / 1e9:.1f} GB/s (NumPy copy)", flush=True)
    for name in args.models.split(","):
        start = time.perf_counter()
        print(f"[measure] profile_step {name} {MEASURED[name]} ...", flush=True)
        out["profiles"][name] = run_self(__file__, ["--worker", "profile", name, "--repeats",
                                                    args.repeats], timeout=1200)
        print(f"[measure]   {name} done in {time.perf_counter() - start:.0f}s", flush=True)
    for r in (2, 4):
        print(f"[measure] all-reduce on {r} logical CPU devices ...", flush=True)
        out["collectives"][r] = run_self(__file__, ["--worker", "collectives", r, "--repeats",
                                                    max(args.repeats, 9)], timeout=600)
    return out


# ------------------------------------------------------------------------ efficiencies


def efficiencies(shape, profile, batch, split_dim, device, sgd_step_s=None):
    """Fraction of this CPU's peak each stage reached here: FLOPs (bytes for the traces) counted
    from the shapes over the measured seconds (summed over the layers ``profile_step`` timed).

    Forward + backward is Keras' fused SGD step when measured (``sgd_step_s``): profile_step's
    stand-alone forward + backward (a separate function recording THOR's inputs) ran up to 2x
    slower than the whole fused step here (ResNet-20: 690 ms against 359 ms), and the fused THOR
    step is within a few % of SGD's (README "Overhead": 159.7 against 161.8 ms)."""
    flops = model_flops(shape, batch, split_dim)
    timed = set(profile["layers"])
    seconds = {"forward_backward": sgd_step_s or profile["forward_backward"],
               "precondition": profile["precondition"]}
    for stage, key in (("traces", "traces"), ("factors", "factors"), ("inversion", "refresh")):
        # Profiles recorded before profile_step timed the rule in use name the refresh "inverse".
        seconds[stage] = sum(v[key] if key in v else v["inverse"]
                             for v in profile["layers"].values())
    out = {}
    for stage, per_layer in flops.items():
        f = sum(x for layer, x in zip(shape.layers, per_layer)
                if stage in ("forward_backward", "precondition") or layer.name in timed)
        precision = STAGE_PRECISION[stage]
        peak = device.memory_bw if precision == "memory" else device.peak[precision]
        out[stage] = f / (seconds[stage] * peak)
    return out


def refresh_fractions(name, shape):
    """Per layer, the fraction of cadence points at which it refreshed in the measured trace-rule
    runs (setting ``thor``: the defaults, frequency 10, mean over seeds). ResNet-50 has none:
    ResNet-20's mean fraction for every layer. Returns ``(fractions, source)``."""
    own = os.path.join(ROOT, "docs", "results", f"bench_trace_rule_{name}.json")
    path = own if os.path.exists(own) else os.path.join(ROOT, "docs", "results", "bench_trace_rule_resnet20.json")
    with open(path) as fh:
        summary = json.load(fh)["summary"]["thor"]
    points = summary["cadence_points"][0]
    per_layer = {k: v[0] / points for k, v in summary["refreshes_per_layer"].items()}
    mean = statistics.fmean(per_layer.values())
    if path != own:
        return [mean] * len(shape.layers), f"{os.path.relpath(path, ROOT)} (mean over layers, borrowed)"
    return [per_layer.get(l.name, mean) for l in shape.layers], os.path.relpath(path, ROOT)


_SHAPES = {}  # (name, input, classes) -> ModelShape: building ResNet-50 takes a second


def costs_for(name, batch, measured, split_dim=128, input_shape=None, classes=None):
    """:class:`Costs` of ``name`` at ``batch`` per replica (projection input unless given), with
    the efficiencies measured on its own measured input."""
    key = (name, input_shape, classes)
    if key not in _SHAPES:
        _SHAPES[key] = model_shape(build_model(name, input_shape, classes), name)
    shape = _SHAPES[key]
    fractions, _ = refresh_fractions(name, shape)
    return Costs(shape, batch, split_dim, model_flops(shape, batch, split_dim),
                 measured["efficiency"][name], fractions)


# ------------------------------------------------------------------------ checks


BENCH_MEASURES = {"sgd": "sgd_step_s", "plain": "plain_step_s", "refresh[all]": "cadence_step_s[all]",
                  "refresh[balanced]": "cadence_step_s[balanced]"}


def here_cluster(measured):
    """This machine as a 'cluster': R logical CPU devices sharing its cores, all-reduce measured."""
    fitted = {int(r): (c["alpha_s"], c["bytes_per_s"]) for r, c in measured["collectives"].items()}
    return Cluster("this CPU, R logical devices", here_device(measured), 64, None, None,
                   shared_compute=True, measured_allreduce=fitted)


def here_device(measured):
    """This CPU with its measured memory bandwidth."""
    return dataclasses.replace(DEVICES["cpu_here"], memory_bw=measured["cpu_memory_bw"])


def remeasure_steps(models, timeout=1800):
    """bench_distributed's worker (fresh process per model and R; SGD, THOR plain and all-refresh
    steps, global batch 128, median of 10 steps) in this session, so that the check compares
    like with like: this shared machine drifts by tens of % between sessions."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_distributed.py")
    rows = []
    for name in models:
        for replicas in (1, 2, 4):
            start = time.perf_counter()
            print(f"[check] bench_distributed worker {name} R={replicas} ...", flush=True)
            rows.append(run_self(script, ["--worker", name, replicas, "--batch", 128,
                                          "--steps", 10], timeout=timeout))
            print(f"[check]   done in {time.perf_counter() - start:.0f}s", flush=True)
    return rows


def local_check(measured, steps, source):
    """Predicted step times at R = 1, 2, 4 on this machine against measured ones (``steps``:
    bench_distributed rows; global batch 128, so the per-replica batch is 128/R). Nothing is
    fitted: every stage comes from the profile (forward + backward from SGD's step at R = 1)."""
    cluster = here_cluster(measured)
    rows = []
    for rec in sorted(steps, key=lambda r: (r["model"], r["replicas"])):
        name, replicas = rec["model"], rec["replicas"]
        if name not in measured["efficiency"]:
            continue
        shape_in, classes, _ = MEASURED[name]
        row = {"model": name, "replicas": replicas, "predicted": {}}
        for assignment in ("all", "balanced"):
            c = costs_for(name, rec["global_batch"] // replicas, measured,
                          measured["split_dim"][name], shape_in, classes)
            t = step_times(c, cluster, replicas, assignment)
            row["predicted"].update({"sgd": t["sgd"], "plain": t["plain"],
                                     f"refresh[{assignment}]": t["refresh"]})
        row["measured"] = {k: rec[v] for k, v in BENCH_MEASURES.items() if v in rec}
        row["error"] = {k: row["predicted"][k] / v - 1 for k, v in row["measured"].items()}
        rows.append(row)
    errors = [abs(e) for row in rows for e in row["error"].values()]
    by_measure = {k: statistics.median(abs(row["error"][k]) for row in rows if k in row["error"])
                  for k in BENCH_MEASURES}
    return {"rows": rows, "source": source,
            "median_abs_error": statistics.median(errors) if errors else None,
            "max_abs_error": max(errors) if errors else None,
            "median_abs_error_by_step": by_measure}


#: MindSpore's published ResNet-50 / ImageNet per-step times on 8 devices (model_zoo THOR README;
#: DESIGN §5): THOR at batch 32 per device, frequency 834, no trace rule; SGD at batch 256.
PUBLISHED = [
    {"what": "THOR, 8 Ascend 910, batch 32/device", "cluster": "ascend910", "batch": 32,
     "step": "amortized", "published_s": 0.0204},
    {"what": "SGD-momentum, 8 Ascend 910, batch 256/device", "cluster": "ascend910", "batch": 256,
     "step": "sgd", "published_s": 0.118},
    {"what": "THOR, 8 V100, batch 32/device", "cluster": "dgx1-v100", "batch": 32,
     "step": "amortized", "published_s": 0.076},
]


def published_check(measured):
    """The model's ResNet-50 steps on 8 devices against MindSpore's, as MindSpore runs them
    (every layer refreshes at every cadence point, frequency 834, every device inverts), with the
    efficiencies carried from this CPU; and with forward + backward's efficiency calibrated on
    the SGD figure, which leaves THOR's extra work the only prediction."""
    rows = []
    calibrated = None
    for item in PUBLISHED:
        cluster = CLUSTERS[item["cluster"]]
        c = costs_for("resnet50", item["batch"], measured)
        c.refresh_fraction = [1.0] * len(c.shape.layers)
        t = step_times(c, cluster, 8, "all", frequency=834)
        row = dict(item, predicted_s=t[item["step"]], parts=t["parts"])
        row["ratio"] = row["predicted_s"] / item["published_s"]
        rows.append(row)
        if item["step"] == "sgd":
            calibrated = row["ratio"]
    for row in rows:
        if row["step"] != "amortized" or calibrated is None:
            continue
        # Forward + backward calibrated on SGD's published step (same device, batch 256).
        c = costs_for("resnet50", row["batch"], measured)
        c.refresh_fraction = [1.0] * len(c.shape.layers)
        c.efficiency = dict(c.efficiency, forward_backward=c.efficiency["forward_backward"]
                            * calibrated)
        t = step_times(c, CLUSTERS[row["cluster"]], 8, "all", frequency=834)
        row["predicted_fb_calibrated_s"] = t["amortized"]
        row["ratio_fb_calibrated"] = t["amortized"] / row["published_s"]
    return rows


# ------------------------------------------------------------------------ projections

REPLICAS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
CASES = [("cnn", 128), ("resnet20", 128), ("resnet50", 32), ("resnet50", 256)]
ASSIGNMENTS = ("all", "balanced", "blocks")


def project(measured, cluster_name, frequency):
    """Every case × R × assignment on one cluster: step times, THOR/SGD, parts."""
    cluster = CLUSTERS[cluster_name]
    out = []
    for name, batch in CASES:
        if name not in measured["efficiency"]:
            continue  # not measured in this run (--models)
        c = costs_for(name, batch, measured)
        for r in REPLICAS:
            row = {"model": name, "batch": batch, "replicas": r}
            for assignment in ASSIGNMENTS:
                t = step_times(c, cluster, r, assignment, frequency)
                row[assignment] = {k: t[k] for k in ("plain", "cadence", "refresh", "amortized")}
                row[assignment]["parts"] = t["parts"]
                row["sgd"], row["sgd_parts"], row["p_any"] = t["sgd"], t["sgd_parts"], t["p_any"]
            for assignment in ASSIGNMENTS:
                row[assignment]["amortized_over_sgd"] = row[assignment]["amortized"] / row["sgd"]
                row[assignment]["refresh_over_sgd"] = row[assignment]["refresh"] / row["sgd"]
            row["bytes"] = collective_bytes(c.shape, r, c.split_dim)
            out.append(row)
        print(f"[project] {cluster_name} {name} b{batch}: THOR/SGD amortized at R=8/64/512 "
              + " / ".join(f"{row_at(out, name, batch, r)['all']['amortized_over_sgd']:.2f}"
                           for r in (8, 64, 512)), flush=True)
    return out


def row_at(rows, name, batch, replicas):
    return next(r for r in rows if r["model"] == name and r["batch"] == batch
                and r["replicas"] == replicas)


def dominant(parts):
    """The largest part of a step and its share."""
    key = max(parts, key=parts.get)
    return key, parts[key] / sum(parts.values())


def sensitivity(measured, cluster_name, frequency, fb_calibration=None):
    """ResNet-50 at batch 32 and 256 at R = 8, 64, 512 under other assumptions: kernel launch 0
    and 10 us; inversion 10x less efficient than on this CPU (small batched Cholesky on a GPU);
    forward + backward's efficiency scaled as the MindSpore SGD check says (``fb_calibration``);
    the trace rule off (every layer refreshes at every cadence point); frequency 100;
    ``split_dim`` 1024 (8x larger blocks: 64x the inversion FLOPs, 8x the factor bytes)."""
    base = CLUSTERS[cluster_name]
    no_launch = dataclasses.replace(base, device=dataclasses.replace(base.device, launch_s=0.0))
    slow_launch = dataclasses.replace(base, device=dataclasses.replace(base.device, launch_s=10e-6))
    variants = {  # label: (cluster, efficiency scales, refresh fraction, frequency, split_dim)
        "as projected": (base, {}, None, frequency, 128),
        "launch 0 us": (no_launch, {}, None, frequency, 128),
        "launch 10 us": (slow_launch, {}, None, frequency, 128),
        "inversion 10x slower": (base, {"inversion": 0.1}, None, frequency, 128),
        "no trace rule": (base, {}, 1.0, frequency, 128),
        "frequency 100": (base, {}, None, 100, 128),
        "split_dim 1024": (base, {}, None, frequency, 1024),
        "split_dim 1024, inversion 10x slower": (base, {"inversion": 0.1}, None, frequency, 1024),
        # The traces read every layer's input and output gradient once: memory-bound, and this
        # CPU reached ~11 % of its bandwidth on them; HBM streaming reductions reach more.
        "traces at 50% of memory bandwidth": (base, {"traces": ("set", 0.5)}, None, frequency, 128),
    }
    if fb_calibration:
        variants["forward+backward calibrated on MindSpore's SGD"] = (
            base, {"forward_backward": fb_calibration}, None, frequency, 128)
    out = {}
    for label, (cluster, scale, fraction, freq, split) in variants.items():
        for batch in (32, 256):
            c = costs_for("resnet50", batch, measured, split_dim=split)
            c.efficiency = {k: (scale[k][1] if isinstance(scale.get(k), tuple)
                                else v * scale.get(k, 1.0)) for k, v in c.efficiency.items()}
            if fraction is not None:
                c.refresh_fraction = [fraction] * len(c.shape.layers)
            for r in (8, 64, 512):
                cell = {}
                for assignment in ASSIGNMENTS:
                    t = step_times(c, cluster, r, assignment, freq)
                    cell[assignment] = {"amortized_over_sgd": t["amortized"] / t["sgd"],
                                        "refresh_over_sgd": t["refresh"] / t["sgd"]}
                out.setdefault(label, {})[f"b{batch} R{r}"] = cell
    return out


def summarize(rows):
    """ResNet-50 at R = 8, 64, 512: THOR/SGD (amortized and refresh step) and the dominant part,
    per assignment; the best assignment by amortized and by refresh step."""
    table = []
    for batch in (32, 256):
        for r in (8, 64, 512):
            row = row_at(rows, "resnet50", batch, r)
            entry = {"batch": batch, "replicas": r, "sgd_ms": 1e3 * row["sgd"]}
            for a in ASSIGNMENTS:
                part, share = dominant(row[a]["parts"])
                entry[a] = {"amortized_ms": 1e3 * row[a]["amortized"],
                            "amortized_over_sgd": row[a]["amortized_over_sgd"],
                            "refresh_ms": 1e3 * row[a]["refresh"],
                            "refresh_over_sgd": row[a]["refresh_over_sgd"],
                            "dominant": part, "dominant_share": share}
            entry["sgd_dominant"] = dominant(row["sgd_parts"])
            thor_only = {k: v for k, v in row["all"]["parts"].items() if k not in row["sgd_parts"]}
            entry["largest_thor_part"] = {k: 1e3 * v for k, v in sorted(
                thor_only.items(), key=lambda kv: -kv[1])[:2]}
            entry["gradient_allreduce_ms"] = 1e3 * row["sgd_parts"]["gradient_allreduce"]
            entry["best_refresh"] = min(ASSIGNMENTS, key=lambda a: row[a]["refresh"])
            entry["best_amortized"] = min(ASSIGNMENTS, key=lambda a: row[a]["amortized"])
            table.append(entry)
    return table


# ------------------------------------------------------------------------ plots

PART_LABELS = {
    "forward_backward": "forward + backward", "update": "momentum update",
    "gradient_allreduce": "gradient all-reduce", "precondition": "preconditioning",
    "traces": "traces (+ exchange) / freq", "factors": "factors / freq",
    "factor_allreduce": "factor all-reduce / freq", "inversion": "inversion / freq",
    "inverse_allreduce": "inverse all-reduce / freq",
}


def plot(summary, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    primary = summary["settings"]["cluster"]
    rows = summary["projections"][primary]
    best = summary["settings"]["plot_assignment"]
    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    for ax, batch in zip(axes[0], (32, 256)):
        series = [row_at(rows, "resnet50", batch, r) for r in REPLICAS]
        keys = [k for k in PART_LABELS if any(s[best]["parts"].get(k, 0) > 0 for s in series)]
        ax.stackplot(REPLICAS, [[1e3 * s[best]["parts"][k] for s in series] for k in keys],
                     labels=[PART_LABELS[k] for k in keys], alpha=0.85)
        ax.plot(REPLICAS, [1e3 * s["sgd"] for s in series], "k--", label="SGD-momentum step")
        ax.set_xscale("log", base=2)
        ax.set_ylim(0, 1.6 * max(1e3 * s[best]["amortized"] for s in series))
        ax.set_xlabel("replicas (GPUs)")
        ax.set_ylabel("ms per step (per replica)")
        ax.set_title(f"ResNet-50 224x224, batch {batch}/GPU, {CLUSTERS[primary].name}\n"
                     f"THOR amortized step (frequency {summary['settings']['frequency']}, "
                     f"inverse_assignment={best!r})", fontsize=9)
        ax.legend(fontsize=7, loc="upper left", ncol=2)
    ax = axes[1][0]
    for cluster, style in ((primary, "-"), (summary["settings"]["second_cluster"], ":")):
        for name, batch in CASES:
            series = [row_at(summary["projections"][cluster], name, batch, r) for r in REPLICAS]
            ax.plot(REPLICAS, [s[best]["amortized_over_sgd"] for s in series], style, marker=".",
                    label=f"{name} b{batch} ({cluster})")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("replicas (GPUs)")
    ax.set_ylabel("THOR amortized step / SGD step")
    ax.set_title("THOR / SGD step ratio against R (weak scaling: batch per GPU fixed)", fontsize=9)
    ax.legend(fontsize=6, ncol=2)
    ax = axes[1][1]
    for (name, batch), marker in zip((("resnet50", 32), ("cnn", 128)), ("o", "s")):
        series = [row_at(rows, name, batch, r) for r in REPLICAS]
        for a, color in zip(ASSIGNMENTS, ("C0", "C1", "C2")):
            ax.plot(REPLICAS, [1e3 * (s[a]["refresh"] - s[a]["cadence"]) for s in series],
                    color=color, marker=marker, label=f"{name} b{batch}: {a}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.set_xlabel("replicas (GPUs)")
    ax.set_ylabel("ms a refresh of every layer adds to a step")
    ax.set_title("What a refresh costs by inverse_assignment\n(factors + exchanges + inversion, "
                 "slowest replica)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_check(summary, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 5.5))
    markers = {"sgd": "o", "plain": "s", "refresh[all]": "^", "refresh[balanced]": "v"}
    for row in summary["check_here"]["rows"]:
        for key, measured in row["measured"].items():
            color = {1: "C0", 2: "C1", 4: "C2"}[row["replicas"]]
            ax.scatter(1e3 * measured, 1e3 * row["predicted"][key], marker=markers[key], color=color,
                       s=25, label=f"here R={row['replicas']} {key}")
    for row in summary["check_published"]:
        ax.scatter(1e3 * row["published_s"], 1e3 * row["predicted_s"], marker="*", s=120,
                   color="C3", label=f"MindSpore: {row['what']}")
        if "predicted_fb_calibrated_s" in row:
            ax.scatter(1e3 * row["published_s"], 1e3 * row["predicted_fb_calibrated_s"], marker="*",
                       s=120, facecolors="none", edgecolors="C3",
                       label="same, forward+backward calibrated on SGD")
    lo, hi = 5, 2000
    ax.plot([lo, hi], [lo, hi], "k-", linewidth=0.8)
    ax.fill_between([lo, hi], [lo * 0.75, hi * 0.75], [lo * 1.25, hi * 1.25], color="grey",
                    alpha=0.2, label="±25 %")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured / published step (ms)")
    ax.set_ylabel("predicted step (ms)")
    ax.set_title("Cost model against measurements", fontsize=10)
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    ax.legend(unique.values(), unique.keys(), fontsize=5.5, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------ main


def derive(measured):
    """Efficiencies and split dims from the raw measurements (kept in the JSON)."""
    device = here_device(measured)
    measured["efficiency"], measured["split_dim"] = {}, {}
    for name, prof in measured["profiles"].items():
        shape_in, classes, batch = MEASURED[name]
        shape = model_shape(build_model(name, shape_in, classes), name)
        measured["efficiency"][name] = efficiencies(shape, prof["profile"], batch,
                                                    prof["split_dim"], device,
                                                    prof.get("sgd_step_s"))
        measured["split_dim"][name] = prof["split_dim"]
    measured["collectives"] = {int(k): v for k, v in measured["collectives"].items()}
    return measured


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/project_scale.json")
    p.add_argument("--models", default="cnn,resnet20,resnet50", help="models to measure here")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per stage (median)")
    p.add_argument("--bench", default=os.path.join(ROOT, "docs", "results", "bench_distributed.json"),
                   help="bench_distributed JSON with the measured R = 1, 2, 4 steps")
    p.add_argument("--check-models", default="cnn",
                   help="models whose R = 1, 2, 4 steps are re-measured for the check (''"
                        "'' uses --bench's recorded ones; resnet20 adds ~10 minutes)")
    p.add_argument("--frequency", type=int, default=10, help="cadence interval projected")
    p.add_argument("--cluster", default="dgx-h100", choices=sorted(CLUSTERS))
    p.add_argument("--second-cluster", default="dgx-a100", choices=sorted(CLUSTERS))
    p.add_argument("--no-measure", action="store_true",
                   help="reuse the measurements in --out (re-project only, seconds)")
    p.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        kind, arg = args.worker
        if kind == "profile":
            report(profile_worker(arg, args.repeats, sgd_steps=10))
        else:
            report(collective_worker(int(arg), args.repeats))
        return

    start = time.perf_counter()
    if args.no_measure:
        with open(args.out) as fh:
            measured = json.load(fh)["measured"]
    else:
        measured = measure(args)
        from experiments import record

        measured["measured_by"] = {k: v for k, v in record.stamp(argv, __file__).items()
                                   if k in ("command", "date", "commit")}
    measured = derive(measured)
    for name, eff in measured["efficiency"].items():
        print(f"[model] {name}: fraction of this CPU's peak per stage: "
              + ", ".join(f"{k} {v:.3f}" for k, v in eff.items()), flush=True)
    summary = {"settings": {"cluster": args.cluster, "second_cluster": args.second_cluster,
                            "frequency": args.frequency, "replicas": REPLICAS,
                            "cases": CASES, "split_dim": 128, "kernels": KERNELS,
                            "stage_precision": STAGE_PRECISION},
               "parameters": {"devices": {k: dataclasses.asdict(v) for k, v in DEVICES.items()},
                              "links": {k: dataclasses.asdict(v) for k, v in LINKS.items()},
                              "clusters": {k: {"name": v.name, "device": v.device.name,
                                               "per_node": v.per_node, "intra": v.intra.name,
                                               "inter": v.inter.name} for k, v in CLUSTERS.items()},
                              "nccl_base_s": NCCL_BASE_S, "link_efficiency": LINK_EFFICIENCY},
               "measured": measured}
    summary["refresh_fractions"] = {}
    for name in PROJECTED_INPUTS:
        shape = model_shape(build_model(name), name)
        fractions, source = refresh_fractions(name, shape)
        summary["refresh_fractions"][name] = {
            "source": source, "mean": statistics.fmean(fractions),
            "per_layer": {l.name: f for l, f in zip(shape.layers, fractions)}}
    print("[check] this machine, R = 1, 2, 4 ...", flush=True)
    if args.no_measure and "check_steps" in measured:
        steps, source = measured["check_steps"], measured["check_source"]
    elif args.check_models:
        steps = remeasure_steps(args.check_models.split(","))
        source = "measured in this run (bench_distributed's worker)"
        measured["check_steps"], measured["check_source"] = steps, source
    else:
        with open(args.bench) as fh:
            bench = json.load(fh)
        steps = bench["results"]
        source = f"{os.path.relpath(args.bench, ROOT)} ({bench.get('date')}, another session)"
    summary["check_here"] = local_check(measured, steps, source)
    for row in summary["check_here"]["rows"]:
        print(f"  {row['model']:9s} R={row['replicas']}  "
              + "  ".join(f"{k} {1e3 * row['predicted'][k]:.1f}/{1e3 * v:.1f}ms "
                          f"({100 * row['error'][k]:+.0f}%)"
                          for k, v in row["measured"].items()), flush=True)
    print(f"  median |error| {100 * summary['check_here']['median_abs_error']:.0f}%, "
          f"max {100 * summary['check_here']['max_abs_error']:.0f}%", flush=True)
    full = all(name in measured["efficiency"] for name in PROJECTED_INPUTS)
    if not full:
        print("[note] ResNet-50, the CNN or ResNet-20 not measured (--models): the published check,"
              " the ResNet-50 summary, the sensitivity and the projection plot are skipped")
    print("[check] MindSpore's published steps ...", flush=True)
    summary["check_published"] = published_check(measured) if full else []
    for row in summary["check_published"]:
        extra = (f", forward+backward calibrated on SGD {1e3 * row['predicted_fb_calibrated_s']:.1f}ms"
                 f" ({row['ratio_fb_calibrated']:.2f}x)" if "predicted_fb_calibrated_s" in row else "")
        print(f"  {row['what']}: predicted {1e3 * row['predicted_s']:.1f}ms, published "
              f"{1e3 * row['published_s']:.1f}ms ({row['ratio']:.2f}x){extra}", flush=True)
    summary["projections"] = {}
    for cluster in dict.fromkeys((args.cluster, args.second_cluster)):
        summary["projections"][cluster] = project(measured, cluster, args.frequency)
    if not full:
        return finish(summary, args, argv, start, plots=False)
    summary["resnet50"] = summarize(summary["projections"][args.cluster])
    calibration = next((row["ratio"] for row in summary["check_published"]
                        if row["step"] == "sgd"), None)
    summary["sensitivity"] = sensitivity(measured, args.cluster, args.frequency, calibration)
    best = [e["best_amortized"] for e in summary["resnet50"]]
    summary["settings"]["plot_assignment"] = max(set(best), key=best.count)
    for e in summary["resnet50"]:
        cells = "  ".join(f"{a} {e[a]['amortized_over_sgd']:.3f}/{e[a]['refresh_over_sgd']:.2f}"
                          for a in ASSIGNMENTS)
        print(f"[resnet50 b{e['batch']} R={e['replicas']}] SGD {e['sgd_ms']:.2f}ms; THOR/SGD "
              f"amortized/refresh: {cells}; dominant {e['all']['dominant']} "
              f"({100 * e['all']['dominant_share']:.0f}%)", flush=True)
    finish(summary, args, argv, start)


def finish(summary, args, argv, start, plots=True):
    """Write the JSON and the plots."""
    from experiments import record

    summary.update({**record.stamp(argv, __file__), "seconds": time.perf_counter() - start})
    record.write(args.out, summary)
    png = os.path.splitext(args.out)[0] + ".png"
    if plots:
        plot(summary, png)
    plot_check(summary, os.path.splitext(args.out)[0] + "_check.png")
    print(f"wrote {args.out}{', ' + png if plots else ''} and the _check.png beside them "
          f"({time.perf_counter() - start:.0f}s)")


if __name__ == "__main__":
    main()
