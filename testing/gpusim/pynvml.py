# gpufleet GPU SIMULATOR: a stand-in for nvidia-ml-py's `pynvml` module -- part of a TEST DOUBLE,
# not NVIDIA software. Installed on simulated test hosts as the system's pynvml
# (/usr/lib/python3/dist-packages), so that gpufleet's health fact, which reads NVML where the host
# has python3 and nvidia-ml-py (facts/health.py NVML_SCRIPT), is exercised on a real host.
#
# Only what that script calls, with nvidia-ml-py's names, constants and error classes
# (nvidia-ml-py 13.615.71). Values are those NVML gave on the recorded H200
# (tests/fixtures/nvidia/h200-x1/health/nvml-health.txt: replays 0, violation times 0, slowdown
# threshold 89 C); other models answer Not Supported where nothing was recorded. Faults that
# `gpusimctl fault` injected change them: `recovery:N` (nvmlGpuRecoveryAction_t N) and
# `pcie-replay:N`. Standard library only.

import json
import os

_ROOT = os.environ.get("GPUSIM_ROOT", "/")
_CONFIG = os.path.join(_ROOT, "etc/gpusim/gpus.json")
_STATE = os.path.join(_ROOT, "run/gpusim/state.json")

NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_TEMPERATURE_THRESHOLD_SLOWDOWN = 1
NVML_PERF_POLICY_POWER = 0
NVML_PERF_POLICY_THERMAL = 1
NVML_FI_DEV_GET_GPU_RECOVERY_ACTION = 230

#: what NVML said on the recorded H200, by simulated model
_RECORDED = {"h200": {"temp_slowdown": 89}}

_MESSAGES = {NVML_ERROR_UNINITIALIZED: "Uninitialized", NVML_ERROR_INVALID_ARGUMENT: "Invalid Argument",
             NVML_ERROR_NOT_SUPPORTED: "Not Supported", NVML_ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded"}


class NVMLError(Exception):
    def __init__(self, value):
        super().__init__(value)
        self.value = value

    def __str__(self):
        return _MESSAGES.get(self.value, "Unknown Error")


class NVMLError_NotSupported(NVMLError):
    def __init__(self):
        super().__init__(NVML_ERROR_NOT_SUPPORTED)


class NVMLError_DriverNotLoaded(NVMLError):
    def __init__(self):
        super().__init__(NVML_ERROR_DRIVER_NOT_LOADED)


class _Struct:
    def __init__(self, **fields):
        self.__dict__.update(fields)


_config = None


def nvmlInit():
    """As the simulated nvidia-smi decides: no loaded driver, no NVML."""
    global _config
    with open(_CONFIG) as f:
        config = json.load(f)
    if not config["driver"]["loaded"]:
        raise NVMLError_DriverNotLoaded()
    _config = config


def nvmlShutdown():
    global _config
    _config = None


def _gpus():
    if _config is None:
        raise NVMLError(NVML_ERROR_UNINITIALIZED)
    return _config["gpus"] if _config["driver"].get("supports_gpus", True) else []


def nvmlDeviceGetCount():
    return len(_gpus())


def nvmlDeviceGetHandleByIndex(index):
    gpus = _gpus()
    if not 0 <= index < len(gpus):
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    return index


def _fault_value(handle, kind):
    """N of the newest `kind:N` fault injected into the GPU (None: none)."""
    try:
        with open(_STATE) as f:
            faults = json.load(f).get("faults", {}).get(str(handle), [])
    except (OSError, ValueError):
        return None
    found = [int(k.split(":", 1)[1]) for k in faults if k.startswith(kind + ":")]
    return found[-1] if found else None


def nvmlDeviceGetPcieReplayCounter(handle):
    return _fault_value(handle, "pcie-replay") or 0


def nvmlDeviceGetViolationStatus(handle, perfPolicyType):
    if perfPolicyType not in (NVML_PERF_POLICY_POWER, NVML_PERF_POLICY_THERMAL):
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    return _Struct(referenceTime=0, violationTime=0)


def nvmlDeviceGetTemperatureThreshold(handle, thresholdType):
    recorded = _RECORDED.get(_config["model"] if _config else "", {})
    if thresholdType != NVML_TEMPERATURE_THRESHOLD_SLOWDOWN or "temp_slowdown" not in recorded:
        raise NVMLError_NotSupported()
    return recorded["temp_slowdown"]


def nvmlDeviceGetFieldValues(handle, fieldIds):
    out = []
    for field_id in fieldIds:
        if field_id == NVML_FI_DEV_GET_GPU_RECOVERY_ACTION:
            action = _fault_value(handle, "recovery") or 0
            out.append(_Struct(fieldId=field_id, nvmlReturn=NVML_SUCCESS, value=_Struct(uiVal=action)))
        else:
            out.append(_Struct(fieldId=field_id, nvmlReturn=NVML_ERROR_NOT_SUPPORTED, value=_Struct(uiVal=0)))
    return out
