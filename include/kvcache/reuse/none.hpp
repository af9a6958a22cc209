// kvcache: the "none" reuse policy: every request recomputes its whole prompt.
#pragma once

#include <string_view>  // name

#include "../concepts.hpp"

KVCACHE_BEGIN_NAMESPACE
namespace reuse {

/// Default reuse policy: nothing is reused across requests (cache_prompt = false).
struct none {
    using policy_kind = reuse_tag;
    static constexpr std::string_view name = "none";
    static constexpr bool needs_shift = false;
};

}  // namespace reuse
KVCACHE_END_NAMESPACE
