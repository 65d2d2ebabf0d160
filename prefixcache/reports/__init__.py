"""Reports: the typed run record (versioned JSON), safe output files, and one rendering toolkit (tables,
number formats, plots, HTML and Markdown documents) used by the run report and the plan report."""
