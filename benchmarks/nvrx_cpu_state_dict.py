"""nvidia-resiliency-ext's ``BasicTensorAwareStateDict`` without its CUDA-only steps, for
``nvrx_local.py`` (a module of its own: the state dict is pickled with ``torch.save``)."""

from nvidia_resiliency_ext.checkpointing.local.basic_state_dict import BasicTensorAwareStateDict


class CpuTensorAwareStateDict(BasicTensorAwareStateDict):
    def __init__(self, state_dict) -> None:  # the base asserts every tensor is_cuda
        self.state_dict = state_dict
        self._is_hollow = False

    def restore_tensor_device(self, non_blocking=True) -> None:  # the base moves every tensor to "cuda"
        pass
