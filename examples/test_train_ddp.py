"""jagflash under DDP and FSDP2: the gradients of one distributed step equal a single-process run
over the union of the ranks' batches, training lowers the loss, and tokens/s per GPU.

    torchrun --nproc_per_node=2 examples/test_train_ddp.py               # 2 GPUs, NCCL, bf16
    python examples/test_train_ddp.py                                     # 1 process, 1 GPU
    torchrun --nproc_per_node=2 examples/test_train_ddp.py --device cpu  # gloo, C++ reference

Checks (every rank runs them; the process exits 1 if any fails on any rank):
  env     the three NVLink-multicast variables are off in this process.
  grad    (ddp, fsdp2) every rank starts from the same weights and takes one backward on its own
          batch; the reference is a plain (unwrapped) copy of the model run on every rank's
          batch in turn, its gradients averaged over ranks, which is what DDP's all-reduce and
          FSDP2's reduce-scatter compute. Max over parameters of |g - g_ref|_inf / |g_ref|_inf
          must stay within the dtype's tolerance. With 2 ranks the check also shows it can fail:
          a rank's local gradient (no averaging) must be farther from the reference than that.
  train   (ddp: --steps, fsdp2: --fsdp2-steps) Adam on each rank's batch: the loss averaged over
          ranks must be finite and the mean of the last 3 steps below the mean of the first 3.
Tokens/s per GPU come from the ddp training run (each rank's tokens over its time per step after
2 warm-up steps); rank 0's batch is the same whatever the world size, so its figure compares
1 GPU with 2 directly. --report-json appends one JSON line per check (rank 0).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_ddp  # noqa: E402  (first: it sets the NVLS variables before torch is imported)

import argparse  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

# Relative (inf-norm) gradient tolerance. CUDA: bf16 autocast; the distributed and the reference
# runs execute the same bf16 kernels, so they differ by the order of fp32 gradient sums plus any
# kernel nondeterminism — far below bf16's 2^-8 resolution; 2e-2 is the bf16 gradient tolerance
# the GPU tests use. CPU: fp32 with a float64 attention reference; only fp32 summation order.
GRAD_TOLERANCE = {"cuda": 2e-2, "cpu": 1e-5}


def parameter_grads(model):
    """Full (unsharded) gradients in parameter order; FSDP2 holds them as sharded DTensors."""
    grads = []
    for p in model.parameters():
        g = p.grad
        grads.append(g.full_tensor() if hasattr(g, "full_tensor") else g.detach().clone())
    return grads


def max_relative_diff(grads, reference):
    """Max over parameters of |g - r|_inf / |r|_inf."""
    return max(
        ((g.float() - r.float()).abs().max() / r.float().abs().max().clamp_min(1e-30)).item()
        for g, r in zip(grads, reference)
    )


def reference_grads(args, device):
    """One unwrapped model, every rank's batch in turn: (gradient averaged over ranks, the
    gradient of each rank's batch alone)."""
    model = train_ddp.build_model(args, device)
    per_rank = []
    for rank in range(dist.get_world_size()):
        model.zero_grad(set_to_none=True)
        train_ddp.batch_loss(model, train_ddp.make_batch(args, rank, device)).backward()
        per_rank.append(parameter_grads(model))
    mean = [torch.stack(gs).mean(0) for gs in zip(*per_rank)]
    return mean, per_rank


def check_env():
    wrong = {k: os.environ.get(k) for k, v in train_ddp.NVLS_OFF.items() if os.environ.get(k) != v}
    return dict(check="env", ok=not wrong, detail=f"not off: {wrong}" if wrong else "NVLS off")


def check_grad(args, device, mode, reference):
    mean, per_rank = reference
    rank = dist.get_rank()
    model = train_ddp.wrap(train_ddp.build_model(args, device), mode, device)
    train_ddp.batch_loss(model, train_ddp.make_batch(args, rank, device)).backward()
    diff = max_relative_diff(parameter_grads(model), mean)
    tolerance = GRAD_TOLERANCE[device.type]
    ok = diff <= tolerance
    detail = f"max rel diff {diff:.2e} (tol {tolerance:.0e})"
    if dist.get_world_size() > 1:
        # Were the gradients not averaged, this rank would hold its own batch's gradient: the
        # check must tell that apart from the reference, or it proves nothing.
        local_diff = max_relative_diff(per_rank[rank], mean)
        ok = ok and local_diff > tolerance
        detail += f"; unaveraged local grad would give {local_diff:.2e}"
    return dict(check=f"grad {mode}", ok=ok, detail=detail, max_rel_diff=diff)


def check_train(args, device, mode, steps):
    batch = train_ddp.make_batch(args, dist.get_rank(), device)
    model = train_ddp.wrap(train_ddp.build_model(args, device), mode, device)
    losses, tokens_per_s = train_ddp.train(model, batch, steps, args.lr)
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    finite = all(torch.isfinite(torch.tensor(losses)).tolist())
    ok = finite and last < first
    return dict(
        check=f"train {mode}", ok=ok, steps=steps, losses=losses, loss_first=losses[0], loss_last=losses[-1],
        detail=f"{steps} steps, loss mean of first 3 {first:.5f} -> last 3 {last:.5f}",
        tokens=len(batch.x), tokens_per_s=tokens_per_s,
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    train_ddp.add_arguments(parser)
    parser.add_argument("--steps", type=int, default=20, help="ddp training steps (at least 6)")
    parser.add_argument("--fsdp2-steps", type=int, default=8, help="fsdp2 training steps (at least 6)")
    args = train_ddp.resolve_defaults(parser.parse_args())
    if min(args.steps, args.fsdp2_steps) < 6:
        parser.error("the loss check compares the first 3 steps with the last 3: use at least 6 steps")
    device = train_ddp.setup_distributed(args)
    rank, world = dist.get_rank(), dist.get_world_size()

    reference = reference_grads(args, device)
    results = [
        check_env(),
        check_grad(args, device, "ddp", reference),
        check_grad(args, device, "fsdp2", reference),
        check_train(args, device, "ddp", args.steps),
        check_train(args, device, "fsdp2", args.fsdp2_steps),
    ]
    # Every rank's verdicts, so a failure on any rank fails them all (and each exits alike).
    all_results = train_ddp.gather(results)
    description = train_ddp.run_description(args, device)
    failed = False
    if rank == 0:
        print(f"== test_train_ddp: {world} rank(s), {description['device']}, {args.backend}, "
              f"H={args.heads} D={args.head_dim} dim={args.dim} layers={args.layers}")
    for i, result in enumerate(results):
        per_rank = [rank_results[i] for rank_results in all_results]
        ok = all(r["ok"] for r in per_rank)
        failed |= not ok
        record = dict(kind="check", script="test_train_ddp.py", **description)
        record.update(result, ok=ok, detail_per_rank=[r["detail"] for r in per_rank])
        if "tokens_per_s" in result:
            record.update(tokens_per_rank=[r["tokens"] for r in per_rank],
                          tokens_per_s_per_rank=[r["tokens_per_s"] for r in per_rank])
        if rank == 0:
            details = record["detail_per_rank"]
            shown = f"all ranks: {details[0]}" if len(set(details)) == 1 else " | ".join(
                f"rank {r}: {d}" for r, d in enumerate(details))
            print(f"{'PASS' if ok else 'FAIL'}  {result['check']:<12} {shown}")
            if "tokens_per_s_per_rank" in record:
                print("      tokens/s per GPU: " + ", ".join(
                    f"rank {r}: {rate:,.0f} ({tokens} tokens/step)" for r, (rate, tokens) in
                    enumerate(zip(record["tokens_per_s_per_rank"], record["tokens_per_rank"]))))
        train_ddp.write_report(args.report_json, record)
    if rank == 0:
        print("== " + ("FAILED" if failed else "all checks passed"))
    del reference
    train_ddp.shutdown()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
