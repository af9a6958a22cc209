// The attention kernels every test executable of one flavour shares (kernel_instances.hpp).
#include <kvcache/kvcache.hpp>

KVCACHE_INSTANTIATE_ATTENTION(kvcache::f32)
KVCACHE_INSTANTIATE_ATTENTION(kvcache::f16)
KVCACHE_INSTANTIATE_ATTENTION(kvcache::bf16)
KVCACHE_INSTANTIATE_ATTENTION(kvcache::q8_0)
KVCACHE_INSTANTIATE_ATTENTION(kvcache::q4_0)
