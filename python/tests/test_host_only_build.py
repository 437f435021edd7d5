"""A kvpolicy built without CUDA refuses CUDA memory with a clear error (CI builds
host-only). The CUDA array is made by hand: a NumPy array's DLPack capsule whose
device says CUDA, which is all a host-only build ever looks at."""

import ctypes

import numpy as np
import pytest

import kvpolicy
from paged_case import make_case

pytestmark = pytest.mark.skipif(kvpolicy.has_cuda, reason="this kvpolicy has its CUDA path")

_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_get_pointer.restype = ctypes.c_void_p
_get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


class CudaLabelled:
    """Exports `array` over DLPack as if it lived on CUDA device 0."""

    def __init__(self, array):
        self.array = array

    def __dlpack_device__(self):
        return (2, 0)

    def __dlpack__(self, stream=None, max_version=None, dl_device=None, copy=None):
        capsule = self.array.__dlpack__()  # an unversioned DLManagedTensor
        tensor = _get_pointer(capsule, b"dltensor")
        ctypes.c_int32.from_address(tensor + ctypes.sizeof(ctypes.c_void_p)).value = 2  # DLTensor.device.device_type
        return capsule


def test_device_arrays_are_refused_naming_the_build_option():
    case = make_case(lengths=(9,))
    kv = case.tensors("nano_vllm")["kv"]
    with pytest.raises(kvpolicy.Error) as e:
        kvpolicy.PagedCache("nano_vllm", CudaLabelled(kv), block_table=case.block_table, lengths=case.lengths)
    assert e.value.field == "kv"
    assert "CUDA device 0" in str(e.value) and "KVPOLICY_PYTHON_CUDA" in str(e.value)
    # The same array labelled as host memory is accepted: it is the label that is refused.
    kvpolicy.PagedCache("nano_vllm", kv, block_table=case.block_table, lengths=case.lengths)
