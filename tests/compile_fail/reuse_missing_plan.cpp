// expect: does not satisfy kvcache::reuse_policy.*r\.plan\(tokens, tokens, opt\)
// A user-written reuse policy without the planning function (required member 6 of
// kvcache::reuse_policy: plan(cached, request, options)) is rejected with a message
// that names the concept, not silently ignored by the slot manager.
#include <kvcache/kvcache.hpp>

struct lazy_reuse {
    using policy_kind = kvcache::reuse_tag;
    static constexpr std::string_view name = "lazy";
    static constexpr bool needs_shift = false;
    static constexpr bool global_cache = false;
    // no plan(): what would the slot manager execute?
};

int main() {
    kvcache::model_shape shape;
    shape.n_cells = 64;
    kvcache::kv_cache<kvcache::f16, kvcache::contiguous<>, lazy_reuse> cache(shape);
    return static_cast<int>(cache.used());
}
