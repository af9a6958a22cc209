// expect: defines on_commit.. but does not declare layout capability .commit_hook.
// A layout storage that defines a hook without declaring its capability (a forgotten
// or misspelled flag would otherwise turn the behaviour off silently) is refused.
#include <kvcache/kvcache.hpp>

struct undeclared_layout {
    using policy_kind = kvcache::layout_tag;
    static constexpr std::string_view name = "undeclared";
    static constexpr std::uint32_t layout_id = 102;
    static constexpr bool can_shift = true;

    template <class Element>
    struct storage : kvcache::tiled_kv_storage<Element, kvcache::v_layout::row_major> {
        using kvcache::tiled_kv_storage<Element, kvcache::v_layout::row_major>::tiled_kv_storage;
        // no `capabilities` declared: on_commit would never run
        void on_commit(kvcache::cell_table&) noexcept {}
    };
};

int main() {
    kvcache::model_shape s;
    kvcache::kv_cache<undeclared_layout> cache(s);
    return 0;
}
