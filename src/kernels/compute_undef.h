/* Ends the float-compute vector macros of an ISA file, so that it can define the double-compute
 * ones for float64 before including norm_impl.h again. Included by each SIMD file. */
#undef W
#undef V
#undef V_SET
#undef V_ADD
#undef V_SUB
#undef V_MUL
#undef V_FMA
#undef VC_LD
#undef VC_LDP
#undef VC_ST
#undef VC_STP
#undef A_ACC
#undef A_SUM
