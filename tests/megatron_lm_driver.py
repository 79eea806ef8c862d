"""One rank of a tiny Megatron-LM training run that checkpoints through Megatron-LM's own code.

Run as ``python tests/megatron_lm_driver.py PHASE CKPT_DIR [MEGATRON-LM ARGS...]`` with
RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set and tests/megatron_lm_site on PYTHONPATH (it puts
the Megatron-LM checkout named by FASTPERSIST_MEGATRON_LM after site-packages; megatron-core
0.19.2's wheel ships megatron.training itself).

Megatron-LM's ``pretrain()`` needs CUDA (it moves the model with ``.cuda()``), so this does what
its training loop does around checkpoints, with Megatron-LM's own pieces: its argument parser
and ``validate_args``, its global state, a megatron-core ``GPTModel`` in megatron-core's
``DistributedDataParallel`` and ``get_megatron_optimizer`` with Megatron-LM's
``OptimizerParamScheduler``, a few training steps, and ``save_checkpoint`` / ``load_checkpoint``
from ``megatron.training.checkpointing`` with a ``checkpointing_context`` as ``pretrain`` keeps.
``PHASE`` is ``train`` (steps 1..N, a checkpoint every ``--save-interval``, a non-persistent one every
``--non-persistent-save-interval`` in between) or ``resume``
(a fresh model, ``load_checkpoint`` from ``--load``, compared with what ``train`` left in
``CKPT_DIR/expected_rank<r>.pt``, then one more step and a save). With ``FASTPERSIST_ENABLE=1``
the run calls ``fastpersist_dist.megatron_lm.enable()`` first, as a user's launcher would (with
``FASTPERSIST_FORMAT`` as its checkpoint format, default torch_dist). With ``HOLD_SAVE=N:DIR`` each rank,
before the checkpoint of iteration N, leaves ``DIR/ready<rank>`` and waits for ``DIR/go`` (the test changes
the world meanwhile: stops the object store).
Prints one JSON line (``RESULT {...}``) for the test.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if torch.is_tensor(v) and "_extra_state" not in k}


def _optimizer_states(optimizer) -> list[dict]:
    """Adam's moments per parameter, of every torch optimizer behind Megatron's (chained) one."""
    return [o.optimizer.state_dict()["state"] for o in getattr(optimizer, "chained_optimizers", [optimizer])]


def _step(model: torch.nn.Module, optimizer, scheduler, args, seed: int) -> float:
    from megatron.core import parallel_state as mpu

    g = torch.Generator().manual_seed(seed * 1000 + mpu.get_data_parallel_rank())
    tokens = torch.randint(0, args.padded_vocab_size, (args.micro_batch_size, args.seq_length), generator=g)
    position_ids = torch.arange(args.seq_length).unsqueeze(0).expand_as(tokens)
    model.zero_grad_buffer()
    optimizer.zero_grad()
    loss = model(tokens, position_ids, None, labels=tokens).float().mean()
    loss.backward()
    model.finish_grad_sync()
    ok, _, _ = optimizer.step()
    assert ok, "optimizer step skipped"
    scheduler.step(increment=args.global_batch_size)
    return float(loss)


def _hold(iteration: int) -> None:
    """``HOLD_SAVE``'s wait before the checkpoint of ``iteration`` (see the module)."""
    held, _, where = os.environ.get("HOLD_SAVE", "").partition(":")
    if held != str(iteration):
        return
    open(os.path.join(where, f"ready{torch.distributed.get_rank()}"), "w").close()
    while not os.path.exists(os.path.join(where, "go")):
        time.sleep(0.05)


def main() -> None:
    phase, ckpt_dir, *megatron_argv = sys.argv[1:]
    if os.environ.get("FASTPERSIST_ENABLE") == "1":
        import fastpersist_dist.megatron_lm

        fastpersist_dist.megatron_lm.enable(os.environ.get("FASTPERSIST_FORMAT", "torch_dist"))

    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel
    from megatron.core.enums import ModelType
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.training import checkpointing
    from megatron.training.arguments import core_transformer_config_from_args, parse_args, validate_args
    from megatron.training.global_vars import set_global_variables
    from megatron.training.training import setup_model_and_optimizer

    sys.argv = ["pretrain_gpt.py", *megatron_argv]
    args = parse_args()
    validate_args(args)
    set_global_variables(args, build_tokenizer=False)
    args.padded_vocab_size = args.vocab_size
    torch.distributed.init_process_group("gloo")
    mpu.initialize_model_parallel(args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
    seed = args.seed + (100 if phase == "resume" else 0)  # resume starts from other weights
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)

    def model_provider(pre_process: bool = True, post_process: bool = True, **kwargs) -> GPTModel:
        return GPTModel(config=core_transformer_config_from_args(args), transformer_layer_spec=get_gpt_layer_local_spec(),
                        vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
                        pre_process=pre_process, post_process=post_process)

    context: dict = {}
    # Megatron-LM's own set-up, as pretrain() does it: get_model (DDP), optimizer, scheduler, and
    # load_checkpoint from --load (nothing there yet in the "train" phase).
    models, optimizer, scheduler = setup_model_and_optimizer(
        model_provider_func=model_provider, model_type=ModelType.encoder_or_decoder, checkpointing_context=context)
    model = models[0]
    rank = torch.distributed.get_rank()
    expected_path = os.path.join(ckpt_dir, f"expected_rank{rank}.pt")
    result: dict = {"rank": rank, "phase": phase}
    from fastpersist_dist.engine.writer_process import writer_client

    result["writer_before_first_save"] = writer_client().pid is not None

    if phase == "train":
        saved = []
        for iteration in range(1, args.train_iters + 1):
            _step(model, optimizer, scheduler, args, iteration)
            if args.async_save:  # as Megatron-LM's train() does after every step: commit finished saves
                from megatron.training.async_utils import maybe_finalize_async_save

                maybe_finalize_async_save(blocking=False)
            if iteration % args.save_interval == 0:
                _hold(iteration)
                checkpointing.save_checkpoint(iteration, models, optimizer, scheduler, 0,
                                              checkpointing_context=context)
                saved.append(iteration)
            elif args.non_persistent_save_interval and iteration % args.non_persistent_save_interval == 0:
                checkpointing.save_checkpoint(iteration, models, optimizer, scheduler, 0,
                                              checkpointing_context=context, non_persistent_ckpt=True)
                saved.append(iteration)
        if args.async_save:
            from megatron.training import async_utils

            from fastpersist_dist.integrations.megatron_lm_queue import MegatronLMQueue

            # the queue Megatron-LM made for --async-save: ours once enable() ran (no caller forked per save)
            result["async_queue_ours"] = isinstance(async_utils._async_calls_queue, MegatronLMQueue)
            async_utils.maybe_finalize_async_save(blocking=True, terminate=True)
        torch.save({"iteration": saved[-1], "params": _params(model), "optim": _optimizer_states(optimizer)},
                   expected_path)
        result["saved"] = saved
    else:
        iteration = args.iteration
        expected = torch.load(expected_path, weights_only=False)
        mismatched = [k for k, v in _params(model).items() if not torch.equal(v, expected["params"][k])]
        result.update(iteration=iteration, expected_iteration=expected["iteration"], mismatched=mismatched,
                      params=len(expected["params"]), num_steps=scheduler.num_steps)
        compared = [torch.equal(now[i][k], v[k])
                    for now, before in zip(_optimizer_states(optimizer), expected["optim"], strict=True)
                    for i, v in before.items() for k in v if torch.is_tensor(v[k])]
        result["optim_compared"] = len(compared)  # Adam's moments (and steps) of every parameter: not none
        result["optim_equal"] = all(compared)
        _step(model, optimizer, scheduler, args, iteration + 1)
        checkpointing.save_checkpoint(iteration + 1, models, optimizer, scheduler, 0, checkpointing_context=context)
        if args.async_save:
            from megatron.training.async_utils import maybe_finalize_async_save

            maybe_finalize_async_save(blocking=True, terminate=True)
    strategy = context.get("save_strategy")
    result["save_strategy"] = [type(strategy).__name__,
                               type(getattr(strategy, "base_strategy", strategy)).__name__]
    result["load_strategy"] = type(context["load_strategy"]).__name__ if "load_strategy" in context else None
    # one write: print() writes the text and its newline apart, and a log line of a background thread can land
    # between them (unbuffered output)
    sys.stdout.write(f"RESULT {json.dumps(result)}\n")
    sys.stdout.flush()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
