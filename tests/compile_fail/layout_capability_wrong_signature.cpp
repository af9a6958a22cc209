// expect: layout capability .placement_plan. is declared but the storage has no
// A layout that declares the placement_plan capability but writes plan_place with
// another signature (here: it returns the cells directly) is refused with a message
// naming the capability, instead of silently using the cache's own slot search.
#include <kvcache/kvcache.hpp>

#include <span>
#include <vector>

struct wrong_plan_layout {
    using policy_kind = kvcache::layout_tag;
    static constexpr std::string_view name = "wrong_plan";
    static constexpr std::uint32_t layout_id = 101;
    static constexpr bool can_shift = true;

    template <class Element>
    struct storage : kvcache::tiled_kv_storage<Element, kvcache::v_layout::row_major> {
        using kvcache::tiled_kv_storage<Element, kvcache::v_layout::row_major>::tiled_kv_storage;
        static constexpr kvcache::layout_caps capabilities = kvcache::layout_caps::placement_plan;

        std::vector<std::uint32_t> plan_place(const kvcache::cell_table&, std::span<const kvcache::pos_t>,
                                              std::span<const kvcache::seq_set>) {
            return {};
        }
    };
};

int main() {
    kvcache::model_shape s;
    kvcache::kv_cache<wrong_plan_layout> cache(s);
    return 0;
}
