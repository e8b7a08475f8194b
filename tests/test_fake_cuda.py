"""verl_longstraw.fake_cuda, the dry run's private torch pieces, pinned one by one on the installed torch: fake CUDA
tensors that index, run autograd and take flash attention; real CPU tensors that stay real; the byte meter; the
FLOP count; the fake process group; the CUDA runtime stand-ins, restored on exit."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import transformers
from torch.nn import functional as F

from verl_longstraw import fake_cuda

pytestmark = pytest.mark.usefixtures("no_default_group")  # conftest: these tests make the fake group


def test_cuda_tensors_are_fake_index_and_backpropagate_while_cpu_tensors_stay_real():
    meter = fake_cuda.DeviceBytes()
    mode = fake_cuda.FakeCuda(meter)
    ids = torch.arange(10)
    with fake_cuda.fake_cuda_runtime(), mode:
        assert int(ids.max()) == 9  # a real CPU tensor: its values are read on the host
        w = torch.empty(4, 8, device=fake_cuda.CUDA, requires_grad=True)
        before = meter.current
        x = ids.to(w.device)
        assert fake_cuda.is_fake(x) and x.device == fake_cuda.CUDA and not fake_cuda.is_fake(ids)
        y = w[1:3, ..., None]  # C++ indexing wants a device guard a CPU build has no CUDA one of
        w2 = torch.zeros(4, 8, device=fake_cuda.CUDA)
        w2[:, torch.tensor([0, 1], device=fake_cuda.CUDA)] = 1.0
        (y * 2).sum().backward()  # autograd's gradient accumulator for a CUDA leaf
        assert w.grad.shape == (4, 8) and w.grad.device == fake_cuda.CUDA
        assert meter.current - before >= x.numel() * 8 + w2.numel() * 4  # what the block made and still holds
        del x, w2
        assert meter.current - before == w.grad.numel() * 4


def test_the_meter_frees_counts_views_once_and_keeps_phase_peaks():
    meter = fake_cuda.DeviceBytes()
    with fake_cuda.fake_cuda_runtime(), fake_cuda.FakeCuda(meter):
        with meter.phase("a"):
            x = torch.empty(1024, device=fake_cuda.CUDA)  # 4 KiB
            view = x[:10].view(2, 5)
            del x
            assert meter.current == 4096  # the view keeps the whole storage, counted once
            del view
        with meter.phase("b"):
            torch.empty(256, device=fake_cuda.CUDA)
    assert meter.phases == {"a": 4096, "b": 1024} and meter.current == 0
    assert meter.largest == 4096 and meter.largest_numel == 1024


def test_an_op_counts_as_the_one_kernel_a_cuda_build_runs():
    """Ops a CUDA build runs as one kernel count their outputs only: ``silu_backward`` (which a CPU-only build would
    decompose before the mode sees it: a CUDA stand-in kernel is registered inside ``fake_cuda_runtime``) and
    ``_log_softmax`` (whose fake implementation is a decomposition run in the mode)."""
    seen: list[str] = []

    class Recorded(fake_cuda.FakeCuda):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not self._depth:  # an op the caller dispatched, not a step of its fake implementation
                seen.append(str(func))
            return super().__torch_dispatch__(func, types, args, kwargs)

    meter = fake_cuda.DeviceBytes()
    mode = Recorded(meter)
    with fake_cuda.fake_cuda_runtime(), mode:
        x = torch.empty(1024, 512, device=fake_cuda.CUDA, dtype=torch.bfloat16, requires_grad=True)
        y = F.silu(x)
        before = meter.current
        grad = torch.autograd.grad(y, x, torch.ones_like(y))[0]
        assert "aten.silu_backward.default" in seen and "aten.sigmoid.default" not in seen
        assert meter.peak - before == 2 * x.nbytes  # d(output) of ones and d(input): no intermediates
        seen.clear()
        meter.reset_peak()
        before = meter.current
        logits = torch.empty(64, 4096, device=fake_cuda.CUDA)
        log_probs = torch.log_softmax(logits, dim=-1)
        assert meter.peak - before == logits.nbytes + log_probs.nbytes  # not its steps' (amax, sub, exp, sum, log)
    assert not torch._C._dispatch_has_kernel_for_dispatch_key("aten::silu_backward", "CUDA") or (
        torch.backends.cuda.is_built())  # the stand-in is taken back on exit
    del grad


def test_attention_takes_the_gpus_kernel_and_its_flops_are_counted():
    mode = fake_cuda.FakeCuda(fake_cuda.DeviceBytes())
    with fake_cuda.fake_cuda_runtime(), mode:
        q = torch.empty(1, 8, 4096, 128, device=fake_cuda.CUDA, dtype=torch.bfloat16, requires_grad=True)
        k = torch.empty(1, 2, 4096, 128, device=fake_cuda.CUDA, dtype=torch.bfloat16, requires_grad=True)
        before = mode.meter.current
        out = F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True)
        assert "Flash" in type(out.grad_fn).__name__  # not the math path, whose scores are [B, H, T, T]
        # its output and float32 logsumexp (and a few bytes of seeds): no scores, and no expanded keys, which torch
        # 2.11's FLOP formula makes to count grouped heads (counted inside the op, not as its memory)
        assert out.nbytes + 8 * 4096 * 4 <= mode.meter.peak - before < out.nbytes + 8 * 4096 * 4 + 1024
        assert mode.flops == 4 * 8 * 4096 * 4096 * 128  # torch's formula: two matmuls, causal or not
        out.sum().backward()
        assert q.grad.shape == q.shape and k.grad.shape == k.shape
    args = (torch.empty(1, 8, 16, 64), torch.empty(1, 8, 16, 64))
    assert fake_cuda.sdp_backend(args[0], *args, attn_mask=torch.empty(16, 16)) == 2  # masks: memory-efficient
    assert fake_cuda.sdp_backend(torch.empty(1, 8, 16, 192), torch.empty(1, 8, 16, 192), args[1]) == 2
    assert fake_cuda.sdp_backend(torch.empty(1, 8, 16, 12), torch.empty(1, 8, 16, 12), torch.empty(1, 8, 16, 12)) == 0


def test_materialize_keeps_ties_and_the_runtime_is_restored():
    config = transformers.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                      tie_word_embeddings=True)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    mode = fake_cuda.FakeCuda()
    fake_cuda.materialize(model, mode)
    assert all(fake_cuda.is_fake(p) and p.device == fake_cuda.CUDA for p in model.parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight
    available, sdpa = torch.cuda.is_available(), F.scaled_dot_product_attention
    with fake_cuda.fake_cuda_runtime():
        assert torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
        torch.cuda.Stream().record_event().synchronize()
        assert torch.cuda.cudart().cudaHostRegister(0, 8, 0) == 0
    assert torch.cuda.is_available() == available and F.scaled_dot_product_attention is sdpa


def test_the_fake_process_group_answers_collectives_and_objects():
    with fake_cuda.fake_process_group(4, rank=1) as group:
        assert dist.get_world_size(group) == 4 and dist.get_rank(group) == 1
        out = torch.empty(8)
        dist.all_gather_into_tensor(out, torch.ones(2), group=group)
        objects = [None] * 4
        with fake_cuda.FakeCuda():
            dist.all_gather_object(objects, {"rank": 1}, group=group)
        assert objects == [{"rank": 1}] * 4  # every rank agrees with this one
    assert not dist.is_initialized()


def test_host_reads_of_fake_values_are_answered_exactly_as_given():
    mode = fake_cuda.FakeCuda()
    with fake_cuda.fake_cuda_runtime(), mode:
        sizes = torch.zeros(2, 3, dtype=torch.long, device=fake_cuda.CUDA)
        with mode.answering([1, 2, 3, 4, 5, 6]):
            assert sizes.tolist() == [[1, 2, 3], [4, 5, 6]]
        with pytest.raises(Exception, match="_local_scalar_dense"):  # outside a block: torch's refusal
            sizes.tolist()
        with pytest.raises(ValueError, match="more host reads"), mode.answering([1, 2]):
            sizes.tolist()
        with pytest.raises(ValueError, match="fewer host reads"), mode.answering([1, 2, 3, 4, 5, 6, 7]):
            sizes.tolist()
        with mode.answering([5]):  # a real CPU tensor is read for real, in a block too
            assert int(torch.tensor(7)) == 7 and sizes[1, 2].item() == 5


def test_a_half_matmul_with_float32_sums_runs_as_on_a_cuda_build():
    """``bmm.dtype`` (bf16 operands, float32 output: the blocked attention's matmul on CUDA) runs on fake tensors
    and is counted, so the dry run takes the half-operand path a CUDA build takes (``ops.attention.blocked.
    matmul_dtype``), not float32 copies of its operands."""
    from verl_longstraw.ops.attention.blocked import matmul_dtype

    mode = fake_cuda.FakeCuda(fake_cuda.DeviceBytes())
    with fake_cuda.fake_cuda_runtime(), mode:
        a = torch.empty(2, 16, 32, device=fake_cuda.CUDA, dtype=torch.bfloat16)
        out = torch.bmm(a, a.transpose(1, 2), out_dtype=torch.float32)
        assert out.dtype == torch.float32 and out.shape == (2, 16, 16)
        assert mode.flops == 2 * 2 * 16 * 16 * 32
        assert matmul_dtype(a) == torch.bfloat16


@pytest.mark.parametrize("offload", [False, True])
def test_fsdp2_shards_trains_and_steps_an_optimizer_on_fake_cuda(offload):
    """FSDP2 as the dry run applies it (``parallel.fsdp2.shard_as_verl``) over 4 fake ranks: its parameters are
    DTensors on cuda (C++ reads a DTensor's device once, at construction), a forward and backward all-gather and
    reduce-scatter, each parameter gets its gradient shard, and AdamW makes its two moments per shard. With veRL's
    ``offload_policy`` (FSDP2's CPU offload, pinned) the shards, gradients and moments are fake host tensors: the
    device holds the buffers only once the step is done, and no real host memory is taken."""
    where = torch.device("cpu") if offload else fake_cuda.CUDA
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from verl_longstraw.parallel.fsdp2 import compute_device, shard_as_verl

    config = transformers.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    meter = fake_cuda.DeviceBytes()
    mode = fake_cuda.FakeCuda(meter)
    with fake_cuda.fake_process_group(4), fake_cuda.fake_cuda_runtime():
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        fake_cuda.materialize(model, mode)
        with mode:
            shard_as_verl(model, init_device_mesh("cuda", (4,)), torch.bfloat16, torch.float32, offload=offload)
            params = list(model.parameters())
            assert all(isinstance(p, DTensor) and p.device == where for p in params)
            assert compute_device(model) == fake_cuda.CUDA  # where the walk runs, offloaded or not
            optimizer = torch.optim.AdamW(params)
            model(input_ids=torch.zeros(1, 8, dtype=torch.long, device="cuda")).logits.float().sum().backward()
            with torch.no_grad():  # a CPU build cannot run autograd's DTensor.to_local on cuda: no CUDA device guard
                assert all(isinstance(p.grad, DTensor) and p.grad.to_local().shape == p.to_local().shape
                           for p in params)
                shards = [t.to_local() for p in params for t in (p, p.grad)] + list(model.buffers())
            # what is alive: the shards, their gradients and the buffers (rotary tables); the unsharded parameters'
            # storages, resized to 0 bytes by FSDP2 after backward, count so (``DeviceBytes.resized``)
            assert all(fake_cuda.is_fake(t) for t in shards)  # on the host too: nothing allocated
            on_device = [t for t in shards if t.device == fake_cuda.CUDA]
            assert meter.current == _storage_bytes(on_device) and len(on_device) == len(shards) - offload * 2 * len(
                params)
            optimizer.step()
        moments = [state[name].to_local() for state in optimizer.state.values() for name in ("exp_avg", "exp_avg_sq")]
        assert len(moments) == 2 * len(params) and all(fake_cuda.is_fake(m) and m.device == where for m in moments)
        assert meter.current == _storage_bytes(on_device + [m for m in moments if m.device == fake_cuda.CUDA])
        assert torch.cuda.current_device() == 0
    assert not dist.is_initialized()


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages of ``tensors``."""
    return sum({fake_cuda.storage_id(t): t.untyped_storage().nbytes() for t in tensors}.values())
