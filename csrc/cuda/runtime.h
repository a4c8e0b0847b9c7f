// Host-callable entry points of the CUDA backend (plain C++ declarations; no CUDA headers here, so
// bindings.cpp and core/ can include this without the toolkit).
#pragma once

namespace lily::cuda {

// Number of visible CUDA devices; 0 (never an exception) when there is no driver or no device.
int device_count();

}  // namespace lily::cuda
