// expect: does not satisfy kvcache::element_policy
// A user-written element policy that forgets from_float must be rejected with a
// message that names the concept.
#include <kvcache/kvcache.hpp>

struct broken_element {
    using policy_kind = kvcache::element_tag;
    using storage_type = float;
    static constexpr std::string_view name = "broken";
    static constexpr std::uint32_t type_id = 99;
    static void to_float(const float*, float*, std::size_t) noexcept {}
};

int main() {
    kvcache::model_shape s;
    kvcache::kv_cache<broken_element> cache(s);
    return 0;
}
