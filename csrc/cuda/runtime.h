// Host-callable entry points of the CUDA backend (plain C++ declarations; no CUDA headers here, so
// bindings.cpp and core/ can include this without the toolkit).
#pragma once

namespace lily::cuda {

// Number of visible CUDA devices; 0 (never an exception) when there is no driver or no device.
int device_count();

// Smoke test of the toolchain: fills n floats on the device with `value`, copies back to dst[n].
// Returns false when there is no device or a CUDA call fails.
bool fill_roundtrip(float* dst, int n, float value);

}  // namespace lily::cuda
