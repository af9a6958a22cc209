#include <chrono>
#include <cstdio>
#include <cstdlib>
#include "engine/engine.hpp"
int main(int argc, char** argv) {
    demo::llama_config cfg;
    cfg.dim = argc > 1 ? std::atoi(argv[1]) : 512;
    cfg.hidden_dim = cfg.dim * 3;
    cfg.n_layers = argc > 2 ? std::atoi(argv[2]) : 6;
    cfg.n_heads = 8; cfg.n_kv_heads = 2; cfg.vocab_size = 259; cfg.seq_len = 4096; cfg.shared_classifier = false;
    auto w = demo::make_random_model(cfg, 42);
    using cache_t = kvcache::kv_cache<kvcache::f32>;
    demo::llama_engine<cache_t> eng(w);
    cache_t cache(eng.cache_shape(4096, 4));
    std::vector<demo::token_t> toks(1000);
    for (int i = 0; i < 1000; ++i) toks[i] = 3 + (i * 7) % 256;
    std::vector<float> logits;
    auto t0 = std::chrono::steady_clock::now();
    eng.eval(cache, toks, 0, 0, logits);
    auto t1 = std::chrono::steady_clock::now();
    std::vector<demo::token_t> one{5};
    for (int i = 0; i < 20; ++i) eng.eval(cache, one, 1000 + i, 0, logits);
    auto t2 = std::chrono::steady_clock::now();
    std::printf("%s prefill %.1f ms decode %.2f ms logit0 %f\n", demo::kv_ops::kernels_name,
        std::chrono::duration<double, std::milli>(t1 - t0).count(), std::chrono::duration<double, std::milli>(t2 - t1).count() / 20, logits[0]);
}
