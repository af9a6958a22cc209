// expect: kvcache: reuse::apply_plan needs a kvcache::kv_memory
// reuse::apply_plan executes a plan on a memory; an int is not one.
#include <kvcache/reuse/plan.hpp>

int main() {
    int not_a_memory = 0;
    auto r = kvcache::reuse::apply_plan(not_a_memory, 0, kvcache::reuse::plan{});
    return r.ok() ? 0 : 1;
}
