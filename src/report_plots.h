// `kvsim report DIR`: figures from a results folder, drawn by gnuplot. kvsim writes only the data
// (.dat) and the gnuplot scripts (.gp) that read it; gnuplot renders the SVG and PNG files, so a
// user can restyle a figure by editing its script and running gnuplot again.
#pragma once
#include <string>

namespace kvsim {

// Reads DIR/results.json, DIR/search.json and DIR/profile.json (whichever exist; at least one
// must) and writes DIR/plots/: per figure NAME.dat, NAME.gp, NAME.svg and NAME.png, plus
// report.md embedding the SVGs. plots/ is built under a temporary name beside it and renamed
// into place when complete, so it appears whole or not at all. Bad input, or no gnuplot on the
// PATH, throws InputError before anything is written. Returns the number of figures.
int write_report_plots(const std::string& dir);

// Reads and checks DIR's inputs and builds their figures as write_report_plots does, writing
// nothing and running no gnuplot: the number of figures, or InputError. The fuzzers' way in
// (tests/fuzz/fuzz_report.cpp).
int check_report_inputs(const std::string& dir);

}  // namespace kvsim
