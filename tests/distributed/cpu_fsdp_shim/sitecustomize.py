"""Let accelerate run FSDP on CPU processes (gloo), for the CI test only.

accelerate 1.15 selects FSDP only on accelerator devices: ``AcceleratorState.__init__`` turns on
``DistributedType.FSDP`` inside the branch for MULTI_GPU/NPU/XPU/... and never for MULTI_CPU, and its
FSDP launcher (``multi_gpu_launcher``) does not pass ``use_cpu`` on (``ACCELERATE_USE_CPU`` is set
only by the simple launcher). On a machine without a GPU, ``accelerate launch --config_file
scripts/accelerate/fsdp2_cpu_gloo.yaml`` therefore starts processes that are not distributed at all.

With ``HYSCALE_CPU_FSDP=1`` in the environment of a launched worker (``LOCAL_RANK`` set), this module
(on ``PYTHONPATH``, imported by Python at startup) makes accelerate (1) take the CPU/gloo backend
(``PartialState`` always built with ``cpu=True``, also when Transformers' ``TrainingArguments`` builds
it) and (2) keep the FSDP plugin it built from the launcher's ``FSDP_*`` variables, so
``accelerator.prepare`` (and the Trainer) run accelerate's own FSDP2 path (``fsdp2_prepare_model`` ->
``fully_shard``) on CPU tensors. Nothing else changes; GPU runs never load it.
"""

import os


def _install() -> None:
    os.environ["ACCELERATE_USE_CPU"] = "true"  # read by AcceleratorState

    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    # PartialState ignores ACCELERATE_USE_CPU, and Transformers' TrainingArguments builds it first
    # (cpu=use_cpu): without a GPU and cpu=False it would not be distributed. Always CPU: gloo, MULTI_CPU.
    original_partial_init = PartialState.__init__

    def partial_init_on_cpu(self, cpu: bool = False, **kwargs):
        original_partial_init(self, True, **kwargs)

    PartialState.__init__ = partial_init_on_cpu

    original_init = AcceleratorState.__init__

    def init_keeping_fsdp(self, *args, fsdp_plugin=None, **kwargs):
        original_init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin
            # As accelerate does for GPUs: every later AcceleratorState() re-reads PartialState's copy.
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP
            if self._mixed_precision != "no":
                fsdp_plugin.set_mixed_precision(self._mixed_precision)

    AcceleratorState.__init__ = init_keeping_fsdp


if os.environ.get("HYSCALE_CPU_FSDP") == "1" and "LOCAL_RANK" in os.environ:
    _install()
