// expect: kvcache: the reuse policy's plans move cells \(needs_shift = true\) but the layout cannot move positions
// A reuse policy whose plans move cells (chunk_shift: needs_shift = true) on a layout that
// cannot move positions (can_shift = false) is a compile error, not a runtime surprise.
#include <kvcache/kvcache.hpp>

/// A layout whose cells never move: the contiguous layout with can_shift = false.
struct fixed_layout : kvcache::contiguous<> {
    static constexpr std::string_view name = "fixed";
    static constexpr bool can_shift = false;
};

int main() {
    kvcache::model_shape shape;
    shape.n_cells = 64;
    kvcache::kv_cache<kvcache::f16, fixed_layout, kvcache::reuse::chunk_shift<8>> cache(shape);
    return static_cast<int>(cache.used());
}
