// Precise tensor dumper (local tool, not part of ferrum): like llama-eval-callback but prints
// full-precision values, a double-precision sum, and optionally writes raw f32 tensors.
// usage: dump MODEL FA(0/1/-1) THREADS OUTDIR_OR_- id id id ...
#include "llama.h"
#include "ggml.h"
#include "ggml-backend.h"
#include <cstdio>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>
#include <map>
static std::string outdir;
static std::map<std::string,int> seen;
static float getf(const uint8_t * d, ggml_type t, size_t off) {
    if (t == GGML_TYPE_F32) return *(const float *)(d + off);
    if (t == GGML_TYPE_F16) return ggml_fp16_to_fp32(*(const ggml_fp16_t *)(d + off));
    if (t == GGML_TYPE_I32) return (float)*(const int32_t *)(d + off);
    return NAN;
}
static bool cb(struct ggml_tensor * t, bool ask, void *) {
    if (ask) return true;
    if (t->type != GGML_TYPE_F32 && t->type != GGML_TYPE_F16) return true;
    std::vector<uint8_t> buf(ggml_nbytes(t));
    ggml_backend_tensor_get(t, buf.data(), 0, buf.size());
    const int64_t * ne = t->ne; const size_t * nb = t->nb;
    int64_t rows = ne[1]*ne[2]*ne[3];
    double sum = 0; std::vector<float> all; all.reserve(ne[0]*rows);
    for (int64_t i3=0;i3<ne[3];i3++) for (int64_t i2=0;i2<ne[2];i2++) for (int64_t i1=0;i1<ne[1];i1++) for (int64_t i0=0;i0<ne[0];i0++) {
        float v = getf(buf.data(), t->type, i0*nb[0]+i1*nb[1]+i2*nb[2]+i3*nb[3]);
        sum += v; all.push_back(v);
    }
    // "last row" = first values of the last token: the last index of the outermost non-1 dim
    int outer = 3; while (outer > 1 && ne[outer] == 1) outer--;
    int64_t per_outer = (int64_t)all.size() / ne[outer];
    size_t last = (size_t)(ne[outer]-1) * per_outer;
    printf("llama-trace %s op=%s type=%s ne=[%lld,%lld,%lld,%lld] sum=%.9g first=[", t->name, ggml_op_desc(t), ggml_type_name(t->type),
        (long long)ne[0],(long long)ne[1],(long long)ne[2],(long long)ne[3], sum);
    for (int i=0;i<4 && i<(int)all.size();i++) printf("%s%.9g", i?", ":"", all[i]);
    printf("] last_row=[");
    for (int i=0;i<4 && last+i<all.size();i++) printf("%s%.9g", i?", ":"", all[last+i]);
    printf("]\n");
    if (!outdir.empty()) {
        int k = seen[t->name]++;
        std::string fn = outdir + "/" + t->name + "." + std::to_string(k) + ".f32";
        FILE * f = fopen(fn.c_str(), "wb");
        if (f) { fwrite(all.data(), 4, all.size(), f); fclose(f); }
    }
    return true;
}
int main(int argc, char ** argv) {
    if (argc < 6) { fprintf(stderr, "usage\n"); return 1; }
    int fa = atoi(argv[2]); int nth = atoi(argv[3]);
    if (strcmp(argv[4], "-") != 0) outdir = argv[4];
    std::vector<llama_token> toks; for (int i=5;i<argc;i++) toks.push_back(atoi(argv[i]));
    llama_backend_init();
    auto mp = llama_model_default_params();
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    auto cp = llama_context_default_params();
    cp.n_ctx = 4096; cp.n_threads = nth; cp.n_threads_batch = nth;
    cp.flash_attn_type = (llama_flash_attn_type)fa;
    cp.cb_eval = cb; cp.cb_eval_user_data = nullptr;
    llama_context * ctx = llama_init_from_model(model, cp);
    llama_batch b = llama_batch_get_one(toks.data(), (int)toks.size());
    if (llama_decode(ctx, b)) { fprintf(stderr, "decode failed\n"); return 1; }
    float * lg = llama_get_logits_ith(ctx, -1);
    int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    int best = 0; for (int i=1;i<n_vocab;i++) if (lg[i] > lg[best]) best = i;
    printf("llama-logits argmax=%d logit=%.9g\n", best, lg[best]);
    llama_free(ctx); llama_model_free(model);
    return 0;
}
