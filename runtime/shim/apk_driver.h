// A host driver's launch of an emitted APK (included after KERNEL_SOURCE):
// the operation's tensor maps through the shim's cuTensorMapEncodeTiled,
// then the resident grid, every CUDA thread a fiber, with the driver's host
// fibers (an attention side posting work) beside it. Trace events go to `log`.
#pragma once

#include <functional>
#include <vector>

namespace apk_driver {

// Encodes phase `ph`'s maps into `tm`; false when the encoder refuses one.
inline bool maps(apk::Templates& tm, uint32_t ph, const apk::MapShape& shape) {
  return apk::encode_tensor_maps(cuTensorMapEncodeTiled, tm, ph, shape);
}

inline void run(const apk::Templates& tm, apk::State* st, uint32_t clusters, std::vector<apk_host::Event>& log,
                const std::vector<std::function<void()>>& host = {}) {
  apk_host::log = &log;
  shim::launch_resident(host, apk::kEntry, clusters * static_cast<uint32_t>(apk::kClusterSize), apk::kThreads,
                        apk::kClusterSize, apk::kSmemBytes, tm, st);
  apk_host::log = nullptr;
}

}  // namespace apk_driver
