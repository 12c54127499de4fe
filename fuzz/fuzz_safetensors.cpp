// A safetensors file (header and data): open, validate, and convert every tensor.
#include <cstdlib>
#include <vector>

#include "core/error.h"
#include "core/safetensors.h"
#include "fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path =
      iris::fuzz::write_scratch_file("model.safetensors", iris::fuzz::as_text(data, size));
  try {
    iris::SafetensorsFile file(path);
    for (const auto& [name, entry] : file.entries()) {
      // Validation promised the bytes match the shape; the conversion reads every one of them.
      if (entry.nbytes > (size_t{64} << 20)) continue;
      const iris::HostTensor t = file.load(name);
      if (static_cast<size_t>(t.numel()) * iris::dtype_size(entry.dtype) != entry.nbytes)
        std::abort();
    }
  } catch (const iris::Error&) {
  }
  return 0;
}
