// expect: has no view.layer. returning kv_layer_view
// A layout written from the concept without the physical K/V format (no view(layer))
// is refused when the cache is instantiated, not deep inside attention or state I/O.
#include <kvcache/kvcache.hpp>

#include <cstddef>
#include <cstdint>

struct no_view_layout {
    using policy_kind = kvcache::layout_tag;
    static constexpr std::string_view name = "no_view";
    static constexpr std::uint32_t layout_id = 103;
    static constexpr bool can_shift = true;

    template <class Element>
    struct storage {
        using storage_type = typename Element::storage_type;
        explicit storage(const kvcache::model_shape&) {}
        std::size_t bytes() const { return 0; }
        std::uint32_t n_cells_padded() const { return 0; }
        void write_k(std::uint32_t, std::uint32_t, const float*) {}
        void write_v(std::uint32_t, std::uint32_t, const float*) {}
        void read_k(std::uint32_t, std::uint32_t, float*) const {}
        void read_v(std::uint32_t, std::uint32_t, float*) const {}
        void copy_cell(std::uint32_t, std::uint32_t) {}
    };
};

int main() {
    kvcache::model_shape s;
    kvcache::kv_cache<no_view_layout> cache(s);
    return 0;
}
