"""Throughput accounting: model FLOPs per training sample, achieved FLOP/s, tokens/s and MFU
(model FLOPs utilisation: achieved / (the device's peak x ranks)).

How FLOPs are counted (once, before training, never inside the timed steps):
- torch: `torch.utils.flop_counter.FlopCounterMode` over one forward and backward pass of the
  run's model with its parameters, buffers and an input batch of the real shape placed on
  torch's *meta* device (`torch.func.functional_call`): shapes only, no arithmetic, no
  memory, no gradient reaches the real parameters (so Horovod's allreduce hooks never fire),
  and the CPU/CUDA RNG states are restored afterwards. A model that needs real values (data-
  dependent control flow, `.item()`, a copy to the host) cannot run there: "unknown".
- TensorFlow: the forward + gradient of the run's Keras model is traced (not run) as a
  tf.function at the real batch shape; every op the gradients need is counted from its
  shapes: TensorFlow's own FLOP statistics (`RegisterStatistics("...", "flops")`) for
  Conv2D and its backprops, 2 x k x the output's size for MatMul/BatchMatMul (TensorFlow's
  BatchMatMul statistic ignores `adj_x`) and 2 x the product of the index sizes for Einsum,
  which TensorFlow has no statistic for. Ops that would hide work from
  this count (loops, conditionals, nested function calls, convolutions without a statistic)
  make it "unknown".
Both count what torch's counter counts: matrix multiplications, convolutions and attention,
2 FLOPs per multiply-add; element-wise work (activations, norms, the optimizer) is left out.
The input's gradient is not computed, so the first layer's backward costs one product, the
others two: a training sample costs about 3x its forward pass.
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass
from typing import Any

# Dense (no structured sparsity) peak TFLOP/s per device, by dtype: vendor datasheets, where
# the table gives "with sparsity" figures they are halved.
#   H100 SXM/PCIe/NVL: NVIDIA H100 Tensor Core GPU datasheet (2023)
#   H200 SXM/NVL:      NVIDIA H200 Tensor Core GPU datasheet (2024)
#   GH200:             NVIDIA GH200 Grace Hopper Superchip datasheet (2023), the GPU
#   A100 (SXM, PCIe):  NVIDIA A100 Tensor Core GPU datasheet (2021)
#   A30, A10, L4, L40, L40S: their NVIDIA datasheets
#   V100 SXM2/PCIe/V100S, T4: NVIDIA V100 / T4 datasheets ("tensor performance": fp16 mixed)
#   RTX 4090: NVIDIA Ada Lovelace architecture whitepaper v1.1, appendix A (FP16/BF16 tensor
#             with FP32 accumulate, what frameworks use; GeForce runs it at half the FP16-
#             accumulate rate)
#   RTX 3090: NVIDIA Ampere GA102 GPU architecture whitepaper v2, table 9 (same convention)
# Volta and Turing have no TF32 (fp32 matmuls run at the fp32 rate) and no bf16 tensor cores.
PEAK_TFLOPS: dict[str, dict[str, float | None]] = {
    "H200 NVL": {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5},
    "H200 SXM": {"fp32": 67.0, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5},
    "H100 NVL": {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5},
    "H100 PCIe": {"fp32": 51.0, "tf32": 378.0, "bf16": 756.5, "fp16": 756.5},
    "H100 SXM": {"fp32": 67.0, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5},
    "GH200": {"fp32": 67.0, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5},
    "A100": {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0},
    "A30": {"fp32": 10.3, "tf32": 82.0, "bf16": 165.0, "fp16": 165.0},
    "A10": {"fp32": 31.2, "tf32": 62.5, "bf16": 125.0, "fp16": 125.0},
    "L40S": {"fp32": 91.6, "tf32": 183.0, "bf16": 362.05, "fp16": 362.05},
    "L40": {"fp32": 90.5, "tf32": 90.5, "bf16": 181.05, "fp16": 181.05},
    "L4": {"fp32": 30.3, "tf32": 60.0, "bf16": 121.0, "fp16": 121.0},
    "V100S PCIe": {"fp32": 16.4, "tf32": 16.4, "bf16": None, "fp16": 130.0},
    "V100 PCIe": {"fp32": 14.0, "tf32": 14.0, "bf16": None, "fp16": 112.0},
    "V100 SXM2": {"fp32": 15.7, "tf32": 15.7, "bf16": None, "fp16": 125.0},
    "T4": {"fp32": 8.1, "tf32": 8.1, "bf16": None, "fp16": 65.0},
    "RTX 4090": {"fp32": 82.6, "tf32": 82.6, "bf16": 165.2, "fp16": 165.2},
    "RTX 3090": {"fp32": 35.6, "tf32": 35.6, "bf16": 71.0, "fp16": 71.0},
}

# Device names as CUDA reports them ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-40GB", "Tesla
# V100-PCIE-32GB", "NVIDIA GeForce RTX 4090") -> table rows; the first match wins. An unlisted
# variant (A10G, RTX 3090 Ti) matches nothing rather than a near neighbour.
DEVICE_PATTERNS: list[tuple[str, str]] = [
    (r"\bH200\b.*\bNVL\b", "H200 NVL"), (r"\bH200\b", "H200 SXM"),
    (r"\bH100\b.*\bNVL\b", "H100 NVL"), (r"\bH100\b.*\bPCIE\b", "H100 PCIe"),
    (r"\bGH200\b", "GH200"), (r"\bH100\b", "H100 SXM"),
    (r"\bA100\b", "A100"), (r"\bA30\b", "A30"), (r"\bA10\b", "A10"),
    (r"\bL40S\b", "L40S"), (r"\bL40\b", "L40"), (r"\bL4\b", "L4"),
    (r"\bV100S\b", "V100S PCIe"), (r"\bV100\b.*\bPCIE\b", "V100 PCIe"), (r"\bV100\b", "V100 SXM2"),
    (r"\bT4\b", "T4"), (r"\bRTX 4090\b(?! D)", "RTX 4090"), (r"\bRTX 3090\b(?! TI)", "RTX 3090"),
]

# TF op types counted: matmuls from their shapes here (TensorFlow's BatchMatMul statistic reads
# `transpose_a`, which BatchMatMul ops do not have - they say `adj_x` - and overcounts every
# transposed product, e.g. each weight gradient of a Dense layer on 3-D input), convolutions
# from TensorFlow's own statistics; and the op types whose work this count cannot see (it would
# be an undercount, so the result is "unknown").
TF_MATMUL_OPS = frozenset({"MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3"})
TF_CONV_OPS = frozenset({"Conv2D", "Conv2DBackpropInput", "Conv2DBackpropFilter", "Conv3D",
                         "DepthwiseConv2dNative"})
TF_OPAQUE_OPS = frozenset({"While", "StatelessWhile", "If", "StatelessIf", "Case",
                           "StatelessCase", "PartitionedCall", "StatefulPartitionedCall",
                           "Conv3DBackpropInputV2", "Conv3DBackpropFilterV2",
                           "DepthwiseConv2dNativeBackpropInput",
                           "DepthwiseConv2dNativeBackpropFilter", "FusedBatchNormV3"})


@dataclass(frozen=True)
class FlopCount:
    """Training FLOPs (forward + backward) of one sample, or None with the reason in `method`."""

    per_sample: float | None
    method: str


@dataclass(frozen=True)
class Peak:
    """One device's peak TFLOP/s for the run's dtype, or None (then no MFU) and why."""

    tflops: float | None
    source: str


def device_row(device_name: str) -> str | None:
    """The PEAK_TFLOPS row for a CUDA device name, or None when the device is not listed."""
    name = device_name.upper()
    for pattern, row in DEVICE_PATTERNS:
        if re.search(pattern, name):
            return row
    return None


def resolve_peak(device_name: str | None, dtype: str, override_tflops: float | None) -> Peak:
    """The peak MFU is measured against: `train.peak_tflops` when set, else the table's entry
    for this GPU and dtype; None on a CPU or an unlisted GPU."""
    if override_tflops is not None:
        return Peak(float(override_tflops), "train.peak_tflops")
    if device_name is None:
        return Peak(None, "CPU: no peak known (set train.peak_tflops for an MFU)")
    row = device_row(device_name)
    if row is None:
        return Peak(None, f"{device_name} is not in ringfeed's peak table "
                          "(set train.peak_tflops for an MFU)")
    tflops = PEAK_TFLOPS[row].get(dtype)
    if tflops is None:
        return Peak(None, f"{row} has no {dtype} peak (set train.peak_tflops for an MFU)")
    return Peak(tflops, f"{row} {dtype} dense, vendor datasheet")


@dataclass(frozen=True)
class Accounting:
    """A run's FLOPs per sample, the peak and the device count: turns samples/s into achieved
    FLOP/s, tokens/s and MFU for the metrics rows and the summary."""

    flops: FlopCount
    peak: Peak
    devices: int  # ranks, one device each
    tokens_per_sample: int | None = None  # token (LM) data: the positions predicted per sample

    def rates(self, samples_per_s: float) -> dict[str, float]:
        """The numbers a metrics row gets (only those that are known)."""
        rates: dict[str, float] = {}
        if self.tokens_per_sample:
            rates["tokens_per_s"] = samples_per_s * self.tokens_per_sample
        if self.flops.per_sample is not None:
            achieved = self.flops.per_sample * samples_per_s
            rates["tflops"] = achieved / 1e12
            if self.peak.tflops:
                rates["mfu"] = achieved / (self.peak.tflops * 1e12 * self.devices)
        return rates

    def summary(self, samples_per_s: float) -> dict[str, Any]:
        """summary.json's "throughput": every value, None where unknown, and how it was got."""
        rates = self.rates(samples_per_s)
        return {"flops_per_sample": self.flops.per_sample, "flops_method": self.flops.method,
                "achieved_tflops": rates.get("tflops"), "mfu": rates.get("mfu"),
                "peak_tflops_per_device": self.peak.tflops, "peak_source": self.peak.source,
                "devices": self.devices, "tokens_per_sample": self.tokens_per_sample,
                "tokens_per_s": rates.get("tokens_per_s")}


def summary_lines(throughput: dict[str, Any]) -> list[str]:
    """The end-of-run summary's compute lines, from summary.json's "throughput"."""
    flops = throughput["flops_per_sample"]
    if flops is None:
        compute = f"FLOPs unknown ({throughput['flops_method']})"
    else:
        compute = (f"{_si(flops)}FLOP/sample, {_si(throughput['achieved_tflops'] * 1e12)}FLOP/s "
                   "achieved")
        peak = throughput["peak_tflops_per_device"]
        if throughput["mfu"] is not None:
            compute += (f", MFU {100 * throughput['mfu']:.1f}% of {throughput['devices']} x "
                        f"{peak:g} TFLOP/s ({throughput['peak_source']})")
        else:
            compute += f", no MFU: {throughput['peak_source']}"
    lines = [f"  compute            {compute}"]
    if throughput.get("tokens_per_s") is not None:
        lines.append(f"  tokens             {throughput['tokens_per_s']:.0f} tokens/s")
    return lines


def _si(value: float) -> str:
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= factor:
            return f"{value / factor:.3g} {prefix}"
    return f"{value:.3g} "


# -- torch ------------------------------------------------------------------------------------
def count_torch_flops(model: Any, input_shape: tuple[int, ...], input_dtype: Any,
                      device: Any = None, tokens: bool = False) -> FlopCount:
    """FlopCounterMode over one forward + backward of `model` on the meta device, per sample.
    `input_shape` includes the batch; uint8 inputs are fed as float, as the trainer does.
    `tokens` (a language model's (batch, tokens) ids): estimated where it cannot be counted."""
    import torch
    from torch.func import functional_call
    from torch.utils.flop_counter import FlopCounterMode

    if input_dtype == torch.uint8:
        input_dtype = torch.float32
    devices = [device] if device is not None and torch.device(device).type == "cuda" else []
    try:
        # the RNG states as they were, whatever a model's forward draws on the meta device
        with torch.random.fork_rng(devices=devices):
            meta = {name: torch.empty_like(t, device="meta").requires_grad_(t.requires_grad)
                    for name, t in itertools.chain(model.named_parameters(),
                                                   model.named_buffers())}
            x = torch.empty(input_shape, dtype=input_dtype, device="meta")
            with FlopCounterMode(display=False) as counter:
                out = functional_call(model, meta, (x,))
                leaves = [t for t in torch.utils._pytree.tree_leaves(out)
                          if isinstance(t, torch.Tensor) and t.requires_grad]
                if not leaves:
                    return FlopCount(None, "unknown: the model's output has no gradient")
                torch.autograd.backward([t.float().sum() for t in leaves])
            total = counter.get_total_flops()
    except Exception as e:  # noqa: BLE001 - any model code may fail on meta tensors
        why = f"the model does not run on torch's meta device ({type(e).__name__}: " \
              f"{_first_line(e)})"
        if not tokens or len(input_shape) != 2:
            return FlopCount(None, f"unknown: {why}")
        return lm_flops_estimate(model, input_shape[1], why)
    if total <= 0:
        return FlopCount(None, "unknown: FlopCounterMode counted no matmul/conv/attention")
    return FlopCount(total / input_shape[0], "torch FlopCounterMode, one forward+backward on "
                                             "the meta device")


def lm_flops_estimate(model: Any, tokens: int, why: str) -> FlopCount:
    """A token model's training FLOPs per sample of `tokens` tokens, where counting failed
    (`why`): 6 N per token for N matmul weights (every parameter of 2+ dimensions but an
    embedding table no layer multiplies by) plus 12 L d T for attention when the model's
    `config` names its layers L and width d (the PaLM paper's appendix B, nanoGPT's and
    torchtitan's MFU). On GPT-2 shapes it is FlopCounterMode's count exactly."""
    import torch

    tables = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    multiplied = {id(p) for m in model.modules() if not isinstance(m, torch.nn.Embedding)
                  for p in m.parameters(recurse=False)}
    weights = sum(p.numel() for p in model.parameters()
                  if p.dim() >= 2 and (id(p) not in tables or id(p) in multiplied))
    config = getattr(model, "config", None)
    layers = _config_value(config, "num_hidden_layers", "n_layer")
    width = _config_value(config, "hidden_size", "n_embd")
    method = f"estimate: 6 x {weights:,} matmul weights per token"
    flops = 6.0 * weights * tokens
    if layers and width:
        flops += 12.0 * layers * width * tokens * tokens
        method += f" + 12 x {layers} layers x {width} wide x {tokens} tokens for attention"
    else:
        method += " (attention not counted: no config.num_hidden_layers/hidden_size)"
    return FlopCount(flops, f"{method}; {why}")


def _config_value(config: Any, *names: str) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


# -- TensorFlow -------------------------------------------------------------------------------
def count_tf_flops(model: Any, input_shape: tuple[int, ...], input_dtype: Any) -> FlopCount:
    """Trace (without running) forward + gradient of the Keras `model` at `input_shape` (batch
    included) and count the ops the gradients need, per sample."""
    import tensorflow as tf

    input_dtype = tf.as_dtype(input_dtype)
    if input_dtype == tf.uint8:
        input_dtype = tf.float32
    variables = [v.value for v in model.trainable_variables]

    def forward_backward(x):
        with tf.GradientTape() as tape:
            outputs = model(x, training=True)
            loss = tf.add_n([tf.reduce_sum(tf.cast(t, tf.float32))
                             for t in tf.nest.flatten(outputs)])
        # the loss too: the real step needs the forward output's value (else its last op
        # would be pruned from the count)
        return loss, tape.gradient(loss, variables)

    try:
        graph = tf.function(forward_backward, autograph=False).get_concrete_function(
            tf.TensorSpec(input_shape, input_dtype)).graph
        total = tf_graph_flops(graph)
    except Exception as e:  # noqa: BLE001 - any model code may fail to trace
        return FlopCount(None, f"unknown: tracing the model failed ({type(e).__name__}: "
                               f"{_first_line(e)})")
    if isinstance(total, str):
        return FlopCount(None, f"unknown: {total}")
    if total <= 0:
        return FlopCount(None, "unknown: no matmul/conv/einsum op in the traced step")
    return FlopCount(total / input_shape[0], "TensorFlow: the traced forward+gradient's "
                                             "matmul/conv/einsum ops, from their shapes")


def tf_graph_flops(graph: Any) -> float | str:
    """FLOPs of the matmul/conv/einsum ops that `graph`'s outputs depend on (the ops TensorFlow
    runs: it prunes the rest, e.g. the first layer's input gradient), or why it cannot count."""
    from tensorflow.python.framework import ops

    needed, todo = set(), [t.op for t in graph.outputs]
    while todo:
        op = todo.pop()
        if op.name in needed:
            continue
        needed.add(op.name)
        todo.extend(t.op for t in op.inputs)
        todo.extend(op.control_inputs)
    total = 0.0
    for op in graph.get_operations():
        if op.name not in needed:
            continue
        if op.type in TF_OPAQUE_OPS:
            return f"the step holds a {op.type} op, whose work this count cannot see"
        if op.type == "Einsum":
            flops = _einsum_flops(op)
        elif op.type in TF_MATMUL_OPS:
            flops = _matmul_flops(op)
        elif op.type in TF_CONV_OPS:
            flops = ops.get_stats_for_node_def(graph, op.node_def, "flops").value
        else:
            continue
        if flops is None:
            return f"{op.type} op {op.name} has shapes unknown at trace time"
        total += float(flops)
    return total


def _matmul_flops(op: Any) -> float | None:
    """2 x k x the output's elements, k the contracted size of the first operand."""
    a, out = op.inputs[0].shape, op.outputs[0].shape
    if not (a.is_fully_defined() and out.is_fully_defined()):
        return None
    attr = "transpose_a" if op.type == "MatMul" else "adj_x"
    k = a[-2] if op.get_attr(attr) else a[-1]
    return 2.0 * k * out.num_elements()


def _einsum_flops(op: Any) -> float | None:
    """2 x the product of every index's size for a two-operand einsum (a multiply and an add
    per term); a one-operand einsum only moves or sums values."""
    equation = op.get_attr("equation").decode().replace(" ", "")
    operands = equation.split("->")[0].split(",")
    if len(operands) < 2:
        return 0.0
    sizes: dict[str, int] = {}
    ellipsis = 1
    for spec, tensor in zip(operands, op.inputs, strict=True):
        shape = tensor.shape
        if shape.rank is None or not shape.is_fully_defined():
            return None
        dims = shape.as_list()
        if "..." in spec:
            head, tail = spec.split("...")
            middle = dims[len(head):len(dims) - len(tail)]
            ellipsis = max(ellipsis, math.prod(middle))
            dims = dims[:len(head)] + dims[len(dims) - len(tail):]
            spec = head + tail
        for letter, size in zip(spec, dims, strict=True):
            sizes[letter] = max(sizes.get(letter, 1), size)
    return 2.0 * math.prod(sizes.values()) * ellipsis


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:200] if text else "no message"
