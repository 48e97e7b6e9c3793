"""FLOPs per token against hand counts, and the exposed-communication arithmetic."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import GarbageCollections
from hpcfsdp.cell.measure.metrics import Span, communication_breakdown, flops_per_token, peak_tflops
from hpcfsdp.cell.models import load_config, resolve_model
from hpcfsdp.contracts.sources import model_source


def meta_model(preset: str):
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(load_config(resolve_model(model_source(preset))))


def test_flops_per_token_qwen25_15b_by_hand():
    # Qwen2.5-1.5B: 28 layers, hidden 1536, 12 heads of 128, 2 KV heads, MLP 8960, vocab 151936, tied.
    h, layers, mlp, vocab, kv = 1536, 28, 8960, 151936, 2 * 128
    attention = h * h + h + 2 * (h * kv + kv) + h * h  # q (+bias), k and v (+bias), o
    per_layer = attention + 3 * h * mlp + 2 * h  # + two RMSNorm weights
    non_embedding = layers * per_layer + h  # + final norm; the tied LM head is the embedding
    seq = 8192
    expected = 6 * non_embedding + 12 * layers * h * seq + 6 * vocab * h
    count = flops_per_token(meta_model("qwen2.5-1.5b"), seq)
    assert count.tied_lm_head and count.non_embedding_params == non_embedding
    assert count.flops_per_token == expected
    # The reference: 30,757 tokens/s per GPU at 41.9% of 989.5 TFLOP/s.
    assert 30_757 * count.flops_per_token / 989.5e12 == pytest.approx(0.419, abs=0.001)


def test_flops_per_token_codellama_7b_by_hand():
    # CodeLlama-7b: 32 layers, hidden 4096, MHA, MLP 11008, vocab 32016, untied LM head (counted).
    h, layers, mlp, vocab = 4096, 32, 11008, 32016
    non_embedding = layers * (4 * h * h + 3 * h * mlp + 2 * h) + h + vocab * h
    count = flops_per_token(meta_model("codellama-7b"), 4096)
    assert not count.tied_lm_head and count.non_embedding_params == non_embedding
    assert count.flops_per_token == 6 * non_embedding + 12 * layers * h * 4096


def test_peak_lookup_and_override():
    assert peak_tflops("NVIDIA H200") == 989.5
    assert peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert peak_tflops("Mystery GPU") == 0.0 and peak_tflops("Mystery GPU", 500.0) == 500.0


def event(name: str, start: float, end: float, device: str = "DeviceType.CUDA", annotation: bool = False) -> Span:
    return Span(name, start, end, on_device=device == "DeviceType.CUDA", annotation=annotation)


def test_exposed_communication_is_what_no_compute_kernel_covers():
    events = [
        event("ampere_bf16_gemm", 0, 100),
        event("ncclDevKernel_AllGather", 50, 150),  # 50 us hidden behind the gemm, 50 exposed
        event("ncclDevKernel_ReduceScatter", 140, 160),  # overlaps the all-gather: union 50..160
        event("elementwise_kernel", 155, 170),  # hides 5 us of it
        event("cpu_op", 0, 1000, device="DeviceType.CPU"),  # host events do not count on a GPU run
        event("ProfilerStep#1", 0, 1000, annotation=True),  # an annotation on the device timeline: no kernel
        event("FSDP::all_gather_copy_in", 40, 160, annotation=True),
    ]
    out = communication_breakdown(events, steps=2)
    assert out["comm_s_per_step"] == pytest.approx(110e-6 / 2)
    assert out["comm_exposed_s_per_step"] == pytest.approx((110 - 50 - 5) * 1e-6 / 2)


def test_on_the_cpu_gloos_collectives_count_though_the_profiler_marks_them_as_annotations():
    """gloo's collectives reach the profiler as record_function ranges ("gloo:all_reduce"): on the
    CPU they are the only communication there is, and all of it is exposed."""
    events = [
        event("gloo:all_reduce", 0, 30, device="DeviceType.CPU", annotation=True),
        event("aten::mm", 10, 50, device="DeviceType.CPU"),
    ]
    out = communication_breakdown(events, steps=1)
    assert out["comm_s_per_step"] == out["comm_exposed_s_per_step"] == pytest.approx(30e-6)


def test_the_communication_profiles_events_are_read_without_a_garbage_collection():
    """Reading a profile makes a Python object of each of its thousands of events, which set off
    full collections of everything the rank holds (most of the tiny CPU cell's measurement phase);
    profiled_spans reads them with the collector paused, and resumes it."""
    import gc

    from torch.profiler import ProfilerActivity, profile

    from hpcfsdp.cell.profiling import profiled_spans

    x = torch.ones(4)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(2000):
            x = x + 1
    with GarbageCollections() as collections:
        events = profiled_spans(prof)
    assert sum(event.name == "aten::add" for event in events) == 2000
    assert collections == [] and gc.isenabled()
