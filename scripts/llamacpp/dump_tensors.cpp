// Precise tensor dumper (a comparison tool, not part of ferrum): like llama-eval-callback but prints
// full-precision values, a double-precision sum, and optionally writes raw f32 tensors.
// usage: llama-dump-tensors MODEL FA(0/1/-1) THREADS OUTDIR_OR_- id id id ...
// Environment: SPLIT=a,b,... decodes the ids in calls of those sizes (the rest in a last call), as
// llama-server does for sliding-window models (e.g. SPLIT=3 for a 7-token prompt: 3 then 4);
// DUMPLAST=1 (default) dumps only the last call; TYPEK/TYPEV (ggml type ids) the cache types; NCTX, NSEQ, KVU, SWAFULL, NBATCH, NUBATCH, SEQ set
// the context parameters; the last call's top-5 is printed in double, f32 and llama-server style.
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
#include <algorithm>
static std::string outdir;
static std::map<std::string,int> seen;
static float getf(const uint8_t * d, ggml_type t, size_t off) {
    if (t == GGML_TYPE_F32) return *(const float *)(d + off);
    if (t == GGML_TYPE_F16) return ggml_fp16_to_fp32(*(const ggml_fp16_t *)(d + off));
    if (t == GGML_TYPE_I32) return (float)*(const int32_t *)(d + off);
    return NAN;
}
static bool g_dump=false;
static bool cb(struct ggml_tensor * t, bool ask, void *) {
    if (ask) return true;
    if (!g_dump) return true;
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
    auto envi=[](const char*k,int d){const char*v=getenv(k);return v?atoi(v):d;};
    cp.n_ctx = envi("NCTX",4096); cp.n_threads = nth; cp.n_threads_batch = nth;
    cp.n_seq_max = envi("NSEQ",1); cp.kv_unified = envi("KVU",0); cp.swa_full = envi("SWAFULL",0);
    cp.n_batch = envi("NBATCH",2048); cp.n_ubatch = envi("NUBATCH",512);
    cp.flash_attn_type = (llama_flash_attn_type)fa;
    // TYPEK / TYPEV: the KV cache's ggml type ids (1 = f16, 0 = f32, 8 = q8_0, 2 = q4_0).
    cp.type_k = (ggml_type)envi("TYPEK", GGML_TYPE_F16); cp.type_v = (ggml_type)envi("TYPEV", GGML_TYPE_F16);
    cp.cb_eval = cb; cp.cb_eval_user_data = nullptr;
    llama_context * ctx = llama_init_from_model(model, cp);
    // SPLIT = comma list of chunk sizes (rest goes in last chunk); DUMPLAST=1 dumps tensors only for the last decode
    std::vector<int> chunks; { const char*v=getenv("SPLIT"); if(v){ std::string s(v); size_t p=0; while(p<s.size()){ size_t q=s.find(',',p); if(q==std::string::npos)q=s.size(); chunks.push_back(atoi(s.substr(p,q-p).c_str())); p=q+1;} } }
    int off=0; size_t ci=0; bool dumplast=envi("DUMPLAST",1);
    while (off < (int)toks.size()) {
        int n = ci<chunks.size()? chunks[ci++] : (int)toks.size()-off;
        if (off+n > (int)toks.size()) n = (int)toks.size()-off;
        bool last = off+n==(int)toks.size();
        g_dump = envi("DUMP",1) && (!dumplast || last);
        llama_batch b = llama_batch_init(n, 0, 1);
        for (int i=0;i<n;i++){ b.token[i]=toks[off+i]; b.pos[i]=off+i; b.n_seq_id[i]=1; b.seq_id[i][0]=envi("SEQ",0); b.logits[i]= (i==n-1)&&last; }
        b.n_tokens=n;
        if (llama_decode(ctx, b)) { fprintf(stderr, "decode failed\n"); return 1; }
        llama_batch_free(b); off+=n;
    }
    float * lg = llama_get_logits_ith(ctx, -1);
    int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    int best = 0; for (int i=1;i<n_vocab;i++) if (lg[i] > lg[best]) best = i;
    printf("llama-logits argmax=%d logit=%.9g\n", best, lg[best]);
    { double mx=lg[best], z=0; for(int i=0;i<n_vocab;i++) z+=exp(lg[i]-mx);
      std::vector<int> idx(n_vocab); for(int i=0;i<n_vocab;i++) idx[i]=i;
      std::partial_sort(idx.begin(), idx.begin()+5, idx.end(), [&](int a,int c){return lg[a]>lg[c];});
      printf("top5:"); for(int k=0;k<5;k++) printf(" %d:%.6f", idx[k], exp(lg[idx[k]]-mx)/z); printf("\n");
      float fmx=lg[best], cs=0.0f; for(int i=0;i<n_vocab;i++) cs+=expf(lg[i]-fmx);
      printf("top5f:"); for(int k=0;k<5;k++) printf(" %d:%.9g(logp=%.9g)", idx[k], expf(lg[idx[k]]-fmx)/cs, log(expf(lg[idx[k]]-fmx)/cs)); printf("\n"); }
    { struct TD{int id; float logit; float p;}; std::vector<TD> cur(n_vocab); for(int i=0;i<n_vocab;i++) cur[i]={i,lg[i],0.0f};
      std::partial_sort(cur.begin(), cur.begin()+5, cur.end(), [](const TD&a,const TD&b){return a.logit>b.logit;});
      float mx=cur[0].logit, cs=0.0f; for(auto&t:cur){t.p=expf(t.logit-mx); cs+=t.p;} for(auto&t:cur) t.p/=cs;
      printf("server-style:"); for(int k=0;k<5;k++) printf(" %d:%.17g", cur[k].id, (double)std::log(cur[k].p)); printf("\n"); }
    llama_free(ctx); llama_model_free(model);
    return 0;
}
