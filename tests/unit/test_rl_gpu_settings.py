"""What each GPU setting of the RL stage asks of vLLM and DeepSpeed (the engine arguments, the learners' hand-over),
and its refusal where it can't apply. These paths build the same arguments on CPU and GPU; only the GPU ones can't
run here (README: GPU paths)."""

import pytest

from stages.common.generation import COLOCATED_GPU_MEMORY, OWN_GPU_MEMORY, engine_args
from stages.common.recipe import RecipeError
from stages.rl.config import RLConfig
from stages.rl.rollout import EXTENSION, engine_settings


def _rl(**sections) -> RLConfig:
    return RLConfig.model_validate({"data": {"paths": ["prompts.jsonl"]}, "reward": {"func": "r.py"}, **sections})


def _args(cfg: RLConfig, gpu: bool) -> dict:
    return engine_args("/m", gpu=gpu, **engine_settings(cfg, colocated=gpu and cfg.ray.colocate_all))


def test_cpu_engines_run_eager_in_process_without_gpu_arguments():
    args = _args(_rl(), gpu=False)
    assert (args["enforce_eager"], args["distributed_executor_backend"], args["tensor_parallel_size"]) == (True, "uni", 1)
    assert "gpu_memory_utilization" not in args and "enable_sleep_mode" not in args
    assert args["enable_chunked_prefill"] is False and args["max_num_batched_tokens"] == 4096
    assert (args["worker_extension_cls"], args["logprobs_mode"]) == (EXTENSION, "processed_logprobs")


def test_gpu_engines_use_cuda_graphs_and_most_of_their_own_gpu():
    args = _args(_rl(), gpu=True)
    assert args["enforce_eager"] is False  # CUDA graphs
    assert args["gpu_memory_utilization"] == OWN_GPU_MEMORY == 0.9
    assert "enable_chunked_prefill" not in args and "enable_sleep_mode" not in args


def test_colocated_engines_leave_the_learners_room_and_may_sleep():
    colocated = _rl(ray={"colocate_all": True})
    assert _args(colocated, gpu=True)["gpu_memory_utilization"] == COLOCATED_GPU_MEMORY == 0.4
    sleeping = _rl(ray={"colocate_all": True}, rollout={"enable_sleep": True})
    assert _args(sleeping, gpu=True)["enable_sleep_mode"] is True
    # the settings given win over the defaults
    given = _rl(ray={"colocate_all": True}, rollout={"gpu_memory_utilization": 0.55, "enforce_eager": True})
    args = _args(given, gpu=True)
    assert (args["gpu_memory_utilization"], args["enforce_eager"]) == (0.55, True)


@pytest.mark.parametrize("gpu", [False, True], ids=["cpu_build", "cuda_build"])
def test_tensor_parallel_engines_run_their_workers_in_vllms_multiprocess_executor(gpu):
    args = _args(_rl(rollout={"tensor_parallel_size": 2}), gpu=gpu)
    assert (args["tensor_parallel_size"], args["distributed_executor_backend"]) == (2, "mp")


def test_sync_backend_is_nccl_on_gpus_and_gloo_on_cpu_unless_named():
    assert (_rl().sync_backend(gpu=True), _rl().sync_backend(gpu=False)) == ("nccl", "gloo")
    assert _rl(sync={"backend": "gloo"}).sync_backend(gpu=True) == "gloo"  # OpenRLHF's vllm_sync_backend gloo
    assert _rl().sync.transport == "broadcast"


@pytest.mark.parametrize("section,value,field,why", [
    ({"rollout": {"enable_sleep": True}, "ray": {"colocate_all": True}}, True, "rollout.enable_sleep", "sleep mode exists on CUDA GPUs only"),
    ({"train": {"enable_sleep": True, "zero_stage": 3}, "ray": {"colocate_all": True}}, True, "train.enable_sleep", "host memory already"),
    ({"rollout": {"enforce_eager": False}}, False, "rollout.enforce_eager", "CUDA graphs exist on GPUs only"),
    ({"rollout": {"gpu_memory_utilization": 0.5}}, 0.5, "rollout.gpu_memory_utilization", "VLLM_CPU_KVCACHE_SPACE"),
    ({"sync": {"backend": "nccl"}}, "nccl", "sync.backend", "NCCL needs GPUs"),
])
def test_gpu_settings_are_refused_by_name_on_cpu(section, value, field, why):
    cfg = _rl(**section)
    cfg.check_device(gpu=True)  # fine on GPUs
    with pytest.raises(RecipeError, match=rf"^{field}: {value!r} is a GPU setting and this run's actors are on CPUs .*{why}"):
        cfg.check_device(gpu=False)


def test_sleep_settings_ask_for_colocation_sync_rollouts_and_zero3():
    with pytest.raises(ValueError, match="rollout.enable_sleep: .*set ray.colocate_all: true"):
        _rl(rollout={"enable_sleep": True})
    with pytest.raises(ValueError, match="rollout.enable_sleep: async engines generate while the learners train"):
        _rl(rollout={"enable_sleep": True, "async": True, "max_staleness": 1}, ray={"colocate_all": True})
    with pytest.raises(ValueError, match="train.enable_sleep: .*set ray.colocate_all: true"):
        _rl(train={"enable_sleep": True, "zero_stage": 3})
    with pytest.raises(ValueError, match="train.enable_sleep: DeepSpeed offloads a ZeRO-3 engine's states only; zero_stage is 2"):
        _rl(train={"enable_sleep": True, "zero_stage": 2}, ray={"colocate_all": True})


def test_how_weights_travel_is_not_part_of_the_run_identity():
    from stages.common.identity import canonical_config

    plain = canonical_config(_rl())
    for other in (_rl(sync={"transport": "object_store"}), _rl(rollout={"enforce_eager": True}),
                  _rl(ray={"colocate_all": True}, rollout={"enable_sleep": True, "gpu_memory_utilization": 0.3})):
        assert canonical_config(other) == {**plain, "ray": canonical_config(other)["ray"]}
