#include "moe/rope.h"

namespace colibri {

void rope(const RopeArgs& a) {
  const int32_t h = a.rotary_dim / 2;
  for (int32_t b = 0; b < a.batch; ++b) {
    for (int32_t t = 0; t < a.tokens; ++t) {
      const float* c = a.cos + b * a.table_stride[0] + t * a.table_stride[1];
      const float* s = a.sin + b * a.table_stride[0] + t * a.table_stride[1];
      // The second half's own table entries, or the first half's again.
      const float* c2 = a.half_table ? c : c + h;
      const float* s2 = a.half_table ? s : s + h;
      for (int32_t head = 0; head < a.heads; ++head) {
        const float* x = a.x + b * a.x_stride[0] + head * a.x_stride[1] + t * a.x_stride[2];
        float* y = a.out + b * a.out_stride[0] + head * a.out_stride[1] + t * a.out_stride[2];
        for (int32_t i = 0; i < h; ++i) {
          const float lo = x[i];
          const float hi = x[i + h];
          // PyTorch's (x * cos) + (rotate_half(x) * sin), rotate_half
          // negating the second half: each product rounded, then the sum.
          y[i] = lo * c[i] - hi * s[i];
          y[i + h] = hi * c2[i] + lo * s2[i];
        }
        if (y != x) {
          for (int32_t i = a.rotary_dim; i < a.head_dim; ++i) y[i] = x[i];
        }
      }
    }
  }
}

}  // namespace colibri
