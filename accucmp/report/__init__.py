"""What a comparison tells the user: the verdict sentence, the terminal summary, csv/json/jsonl/
xlsx tables, the HTML report and the export to the original Ascend layout."""
