/* Undefines the compute-type macros of an ISA file (see rows_impl.h), so that the file can
 * switch from float compute (f32, f16, bf16) to double compute (f64). */
#undef W
#undef V
#undef V_LDC
#undef V_STC
#undef V_LDCP
#undef V_STCP
#undef V_SET
#undef V_ADD
#undef V_SUB
#undef V_MUL
#undef V_FMA
#undef A_WIDEN
#undef A_CVT
