// kvcache: recurrent and hybrid memory with prefix reuse through slots and checkpoints
// (issue 28): the README's example of the section "Recurrent and hybrid memory". The host
// computes each prompt in pieces that end at prepared_request::checkpoints and saves a
// checkpoint there; a repeat or a shorter common prefix resumes from the newest one at or
// below it, and a lost prefix is reported (miss reason no_checkpoint), never silently.
#include <kvcache/kvcache.hpp>

#include <cstdio>
#include <numeric>
#include <vector>

int main() {
    using namespace kvcache;
    // Attention in layers 1 and 3 (f32 K/V, global prompt cache), recurrent layers 0 and 2.
    using memory_t = hybrid_memory<kv_cache<f32, reuse::global<>>>;
    model_shape attn;
    attn.n_layer = 2;  // attention layers only
    attn.n_head_kv = 2;
    attn.head_dim_k = 64;
    attn.n_cells = 4096;
    attn.n_seq_max = 2;
    recurrent_shape rec;
    rec.n_layer = 2;  // recurrent layers only
    rec.n_seq_max = 2;
    rec.d_conv = 4;
    rec.d_inner = 256;
    rec.ssm_size = 256 * 16;  // d_inner x d_state
    memory_t mem(attn, rec, {true, false, true, false});

    // Checkpoints every 256 positions and one before the prompt end, at most 4 and 64 MiB per slot.
    slot_manager<memory_t> slots(mem, {.n_slots = 2, .max_checkpoints = 4,
                                       .max_checkpoint_bytes = std::size_t{64} << 20, .checkpoint_every = 256});

    // The host's forward pass over positions [from, to) of `seq` (here: zeros as K/V, the
    // recurrent states left as they are; a real engine runs its layers).
    auto compute = [&](const prompt_tokens& p, seq_id_t seq, std::size_t from, std::size_t to) {
        std::vector<pos_t> pos(to - from);
        std::iota(pos.begin(), pos.end(), static_cast<pos_t>(from));
        const std::vector<seq_id_t> seqs(pos.size(), seq);
        transaction tx(mem);
        auto placed = mem.place(pos, seqs).value();
        const std::vector<float> rows(pos.size() * 2 * 64, 0.0f);
        for (std::uint32_t l = 0; l < mem.n_layer(); ++l) {
            if (mem.is_recurrent(l)) {
                std::span<float> conv = mem.conv_state(l, seq), ssm = mem.ssm_state(l, seq);
                static_cast<void>(conv), static_cast<void>(ssm);  // update them token by token
            } else {
                mem.write_k(l, placed, rows.data());
                mem.write_v(l, placed, rows.data());
            }
        }
        static_cast<void>(p);
        tx.commit();
    };
    auto serve = [&](const prompt_tokens& prompt) {
        prepared_request r = slots.prepare(prompt).value();
        std::size_t at = r.n_past;
        for (std::uint32_t b : r.checkpoints) {  // compute up to each checkpoint, save it there
            compute(prompt, r.seq, at, b);
            at = b;
            static_cast<void>(slots.save_checkpoint(r.slot));  // refused: only less reuse later
        }
        compute(prompt, r.seq, at, prompt.size());
        slots.commit_prompt(r.slot);
        slots.release(r.slot);  // idle; saved with its checkpoints to the global prompt cache
        std::printf("computed %u of %u, checkpoint restored: %d, miss: %s\n", r.metrics.computed, r.n_request,
                    r.metrics.checkpoint_restored, to_string(r.metrics.miss));
    };
    std::vector<token_t> t(1000);
    std::iota(t.begin(), t.end(), 1);
    const prompt_tokens prompt{std::span<const token_t>(t)};
    serve(prompt);  // computed 1000 of 1000
    serve(prompt);  // computed 1 of 1000: resumed from the checkpoint at 999
    prompt_tokens other = prompt;
    other.keep_first(600);
    other.push_back(7);
    serve(other);   // computed 89 of 601: resumed from the checkpoint at 512, miss no_checkpoint
}
