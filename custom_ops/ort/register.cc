// The library's one exported symbol. Usage (Python):
//   so = onnxruntime.SessionOptions(); so.register_custom_ops_library(ortkv.get_library_path())
#include <mutex>

#include "ops.h"
#include "ort_util.h"

namespace ortkv_ort {
const OrtApi* g_api = nullptr;
}

using ortkv_ort::g_api;

extern "C" __attribute__((visibility("default"))) OrtStatus* ORT_API_CALL
RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base) {
  // API 29 is what the headers were fetched at; any runtime >= 1.29 provides it.
  const OrtApi* api = api_base->GetApi(ORT_API_VERSION);
  if (api == nullptr) {
    // Without an API table we cannot even build a status; ORT reports a null table as a failure.
    return api_base->GetApi(1)->CreateStatus(
        ORT_FAIL, "[ortkv:E_RUNTIME] ortkv needs onnxruntime >= 1.29 (C API version 29); this runtime is older");
  }
  static std::once_flag once;
  static OrtCustomOpDomain* domain = nullptr;
  static OrtStatus* create_error = nullptr;
  std::call_once(once, [api]() {
    g_api = api;
    OrtStatus* s = api->CreateCustomOpDomain("ortkv", &domain);
    for (const OrtCustomOp* op : ortkv_ort::AllOps()) {
      if (s != nullptr) break;
      s = api->CustomOpDomain_Add(domain, op);
    }
    create_error = s;
  });
  if (create_error != nullptr) {
    return api->CreateStatus(api->GetErrorCode(create_error), api->GetErrorMessage(create_error));
  }
  // One domain object serves every session (it only lists the ops); it lives as long as the process.
  return api->AddCustomOpDomain(options, domain);
}
