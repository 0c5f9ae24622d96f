#include "bwd/config.h"

namespace hf_flash {

size_t bwd_workspace_bytes(const BwdParams& params) { return bwd::WorkspaceLayout(params).bytes; }

}  // namespace hf_flash
