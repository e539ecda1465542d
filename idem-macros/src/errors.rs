//! Collects every error of one expansion, so the user sees them all at once.

#[derive(Default)]
pub struct Errors {
    all: Option<syn::Error>,
    count: usize,
}

impl Errors {
    pub fn push(&mut self, error: syn::Error) {
        self.count += 1;
        match &mut self.all {
            Some(all) => all.combine(error),
            None => self.all = Some(error),
        }
    }

    /// How many errors so far; lets a stage tell whether it added any.
    pub fn count(&self) -> usize {
        self.count
    }

    pub fn into_result(self) -> syn::Result<()> {
        self.all.map_or(Ok(()), Err)
    }
}
